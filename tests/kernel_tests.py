"""What the Triton kernel tests share: a cases script run in Triton's interpreter, and the `gpu` mark."""

import os
import subprocess
import sys

import pytest
import torch


def run_in_the_interpreter(test_file: str, script: str, *args: str) -> str:
    """The last line the cases script beside `test_file` prints when run with TRITON_INTERPRET=1 and
    `args` (in a subprocess: Triton reads the variable when the kernels are defined); fails the test
    if the script fails."""
    path = os.path.join(os.path.dirname(test_file), script)
    # the scripts import the tests' helpers (e.g. ssm.packed_documents) as pytest does (conftest.py)
    search_path = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, path, *args], env={**os.environ, "TRITON_INTERPRET": "1",
                                                         "PYTHONPATH": search_path},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split("\n")[-2]


def gpu_test(test):
    """Marked `gpu` (conftest.py leaves CUDA visible) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


H100_SHARED_MEMORY = 227 * 1024  # bytes a block may use


def compile_for_sm90(kernel, dtype: str, activations: str, fp32: str = "", floats: str = "", constexprs=None,
                     options=None, ints: str = ""):
    """Triton and ptxas compile `kernel` for sm_90 without a GPU: `activations` (names, space-separated)
    point to `dtype` ("bf16", "fp32"), `fp32` to fp32, `ints` to int32, `floats` are fp32 scalars, the
    other arguments int32 unless `constexprs` names them. Returns the compiled kernel's metadata (shared
    memory, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {arg: value for arg, value in (constexprs or {}).items() if arg in kernel.arg_names}
    types = {**{arg: f"*{dtype}" for arg in activations.split()}, **{arg: "*fp32" for arg in fp32.split()},
             **{arg: "*i32" for arg in ints.split()}, **{arg: "fp32" for arg in floats.split()}}
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(arg),): value
                                                      for arg, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options or {}).metadata
