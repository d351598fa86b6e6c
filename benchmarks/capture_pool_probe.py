"""Probe: what a capture that raised leaves behind in the CUDA caching allocator, and what ends it.

    python benchmarks/capture_pool_probe.py

GraphedMicroSteps captures every micro-step into one shared memory pool. On the H100 (torch 2.11) a capture that
raised left every later capture into that pool failing with "beginAllocateToPool: already recording to mempool_id".
This prints, step by step, what each call raises and which of torch's private pool functions this torch has; then
what GraphedMicroSteps does after a failed capture (the stream it started on made current again, the random state
reset, a new pool). On the H100: ending the allocator's recording by hand did not make the old pool usable again; a
new pool works.
"""

import torch


def attempt(what, fn):
    try:
        out = fn()
        print(f"{what}: ok{'' if out is None else f' -> {out}'}")
        return True
    except Exception as err:  # noqa: BLE001 - a probe reports every failure
        print(f"{what}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        return False


def main() -> None:
    from litft.train.engines import reset_capture_state

    print("torch", torch.__version__)
    print("pool functions:", sorted(n for n in dir(torch._C) if "Pool" in n and n.startswith("_cuda")))
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream()
    pool = torch.cuda.graph_pool_handle()
    print("pool handle:", pool)

    attempt("capture with a host copy inside", lambda: failing_capture_into(pool))
    print("current stream after it:", torch.cuda.current_stream(), "before:", stream)
    attempt("second capture into the pool, before any reset", lambda: capture_into(pool))
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            attempt(f"{name}({device}, pool)", lambda fn=fn: fn(device, pool))
    attempt("second capture into the pool, after ending its recording", lambda: capture_into(pool))

    # what GraphedMicroSteps does after a capture that raised: the stream back, the random state reset, a new pool
    torch.cuda.set_stream(stream)
    fresh = torch.cuda.graph_pool_handle()
    attempt("failing capture into a fresh pool", lambda: failing_capture_into(fresh))
    torch.cuda.set_stream(stream)
    attempt("reset_capture_state()", reset_capture_state)
    attempt("capture into that pool again", lambda: capture_into(fresh))
    attempt("capture into a new pool (expect 6.0)", lambda: capture_into(torch.cuda.graph_pool_handle()))
    print("current stream at the end:", torch.cuda.current_stream())


def failing_capture_into(pool) -> None:
    x = torch.ones(64, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool, capture_error_mode="thread_local"):
        (x * 2).sum().item()


def capture_into(pool) -> float:
    x = torch.ones(64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        y = x * 3
    x.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    return float(y[0])


if __name__ == "__main__":
    main()
