"""Probe: what a capture that raised leaves behind in the CUDA caching allocator, and what ends it.

    python benchmarks/capture_pool_probe.py

GraphedMicroSteps captures every micro-step into one shared memory pool. On the H100 (torch 2.11) a capture that
raised left every later capture into that pool failing with "beginAllocateToPool: already recording to mempool_id".
This prints, step by step, what each call raises, and which of torch's private pool functions this torch has, so
litft.finetune.reset_capture_state can be checked against the torch it runs on.
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
    print("torch", torch.__version__)
    print("pool functions:", sorted(n for n in dir(torch._C) if "Pool" in n and n.startswith("_cuda")))
    device = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    print("pool handle:", pool)
    x = torch.ones(64, device="cuda")

    def failing_capture():
        with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=pool, capture_error_mode="thread_local"):
            (x * 2).sum().item()

    attempt("capture with a host copy inside", failing_capture)
    print("current stream after it:", torch.cuda.current_stream(), "default:", torch.cuda.default_stream())

    def capture_again():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            y = x * 3
        graph.replay()
        torch.cuda.synchronize()
        return float(y[0])

    attempt("second capture into the pool, before any reset", capture_again)
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            attempt(f"{name}({device}, pool)", lambda fn=fn: fn(device, pool))
    attempt("second capture into the pool, after ending its recording", capture_again)
    from litft.finetune import reset_capture_state

    attempt("failing capture again", failing_capture)
    attempt("reset_capture_state(device, pool)", lambda: reset_capture_state(torch.device("cuda", device), pool))
    attempt("capture after reset_capture_state", capture_again)


if __name__ == "__main__":
    main()
