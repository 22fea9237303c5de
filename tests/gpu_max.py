"""Triton's interpreter with the GPUs' elementwise max and min.

With the default `propagate_nan`, `tl.maximum`/`tl.minimum` lower to maxnum/minnum: the GPUs drop a NaN operand
there (NVIDIA `max.f32`, gfx12 `v_max_num_f32`), while Triton 3.6's interpreter runs them as numpy's NaN-propagating
maximum/minimum. (Its reductions, `tl.max`/`tl.min`, already drop NaN as the GPUs do.) Kernels tested only under the
interpreter could so pass NaN through where the GPU loses it; the Triton fuzz under the interpreter and
tests/test_triton_nonfinite.py run with the GPUs' rule instead."""


def drop_nan_in_max() -> None:
    """Make the interpreter's maxnum/minnum drop a NaN operand (numpy's fmax/fmin), for this process."""
    import numpy as np
    from triton.runtime import interpreter

    interpreter.InterpreterBuilder.create_maxnumf = lambda self, a, b: self.binary_op(a, b, np.fmax)
    interpreter.InterpreterBuilder.create_minnumf = lambda self, a, b: self.binary_op(a, b, np.fmin)
