"""Compile recorded Triton launches for a CUDA target on a machine without a GPU (Triton's front end, its LLVM
NVPTX back end and the ptxas it ships run anywhere): the step the interpreter skips, where rules of compiled
Triton (only constexpr globals in a jit function, the types its scalar arguments get) are enforced.

    python -m tests.distributed.triton_compile ARCH < launches.json   # prints {"compiled": n, "errors": [...]}

Run in a process without ``TRITON_INTERPRET`` (the kernels must be decorated in compiled mode)."""

import json
import re
import sys


def compile_launches(launches, arch: int = 90):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_kl.vocab_parallel import triton_kernels

    target = GPUTarget("cuda", arch, 32)
    compiled, errors, seen = 0, [], set()
    for launch in launches:
        key = json.dumps(launch, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        kernel = getattr(triton_kernels, launch["kernel"])
        signature = {name: "constexpr" for name in kernel.arg_names}
        signature.update(launch["signature"])
        index = {name: i for i, name in enumerate(kernel.arg_names)}
        constexprs = {(index[name],): value for name, value in launch["constexprs"].items()}
        try:
            binary = triton.compile(
                ASTSource(kernel, signature, constexprs=constexprs), target=target, options=launch["options"]
            )
            assert binary.asm.get("cubin"), "no cubin"
            # float32 arithmetic not contracted into fmas (triton_stats.LAUNCH_OPTIONS); float64's come from
            # libdevice's exp, written with explicit fmas, the same in the forward and the backward
            fused = sorted(set(re.findall(r"\bfma\.\w+\.f32", binary.asm["ptx"])))
            assert not fused, f"fused multiply-adds in the PTX: {fused} (forward and backward would round apart)"
            compiled += 1
        except Exception as error:  # noqa: BLE001 - every failure is reported with its launch
            errors.append({"launch": launch, "error": f"{type(error).__name__}: {error}"[-2000:]})
    return {"compiled": compiled, "errors": errors}


if __name__ == "__main__":
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    print(json.dumps(compile_launches(json.load(sys.stdin), arch)))
