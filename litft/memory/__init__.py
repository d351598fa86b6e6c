"""The predicted memory ledger: what `litft estimate` prints and every run writes beside its measured peak.

    ledger.py  model state by role and precision, activations, the loss, sharding and offload plans
    trace.py   the activations one block keeps per token, traced on the CPU with the run's plan
    fit.py     the changes that would make a recipe fit a memory budget
"""

from litft.memory.fit import what_would_fit
from litft.memory.ledger import (
    ALLOCATOR_OVERHEAD,
    ALLOCATOR_OVERHEAD_QLORA,
    CUDA_CONTEXT_GIB,
    OFFLOAD,
    SHARDING,
    MemoryEstimate,
    Part,
    estimate_memory,
    shard_model_state,
)
from litft.memory.trace import activation_bytes_per_token_layer

__all__ = [
    "ALLOCATOR_OVERHEAD", "ALLOCATOR_OVERHEAD_QLORA", "CUDA_CONTEXT_GIB", "OFFLOAD", "SHARDING", "MemoryEstimate",
    "Part", "activation_bytes_per_token_layer", "estimate_memory", "shard_model_state", "what_would_fit",
]
