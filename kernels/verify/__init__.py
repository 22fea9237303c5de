"""What only tests and developers run, never imported by a user's run (tests/test_package_layout.py checks it):
the CPU simulator of the HIP kernels (host_sim.py, sim_runtime.h), the CUDA twin of the HIP loader's runtime and
compiler (cuda_twin.py: the HIP backends on NVIDIA, SAGE_RDNA4_HIP_EMULATE=1), the CUDA emulation runner
(cupy_runner.py),
the checks of the HIP kernels against the spec (hip_checks.py), the static checks of the HIP kernels
(hip_static_check.py, clang-19) and of the Triton kernels (triton_aot.py, Triton's AMD backend), and what Triton
compiles cost (compile_keys.py counts them, triton_compile_gil.py times them in threads and processes)."""
