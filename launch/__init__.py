"""Local processes on loopback ports: llama-server, Valkey and ``kvtier serve``.

What ``kvtier demo``, the tests and the benchmarks start, written once. ``kvtier serve`` never
imports this package; the demo imports it when it runs, which is the only reason it is in the wheel.
"""

from launch.binaries import (
    LLAMA_CPP_PYTHON_PIN,
    free_port,
    gemma3_path,
    llama_server_binary,
    smollm2_path,
    valkey_binary,
)
from launch.processes import (
    LlamaServer,
    Node,
    Proc,
    ValkeyServer,
    valkey,
    valkey_server,
    wait_port,
)

__all__ = [
    "LLAMA_CPP_PYTHON_PIN",
    "LlamaServer",
    "Node",
    "Proc",
    "ValkeyServer",
    "free_port",
    "gemma3_path",
    "llama_server_binary",
    "smollm2_path",
    "valkey",
    "valkey_binary",
    "valkey_server",
    "wait_port",
]
