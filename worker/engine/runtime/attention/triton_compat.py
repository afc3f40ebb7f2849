"""What the kernels need to run the same way on every triton we support (3.2 to 3.9).

The GPU machine has triton 3.6, CI and the dev box 3.9. Compiled code behaves the
same on both; the interpreter (TRITON_INTERPRET=1, CPU tests) does not: triton
< 3.7 turns a loop bound into a Python int with `int(array)`, and a scalar loaded in
the interpreter is an array of shape (1,), which numpy >= 2.4 refuses to convert
("only 0-dimensional arrays can be converted to Python scalars"). Every
`range(start, end, BLOCK)` with loaded bounds then fails. triton 3.7+ squeezes
first; `patch_interpreter()` gives the older interpreter the same conversion.
It touches nothing unless the interpreter is on, and never the compiled path.
"""

from __future__ import annotations

import os
from typing import Any


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def patch_interpreter() -> bool:
    """Make the interpreter's tensor.__index__ squeeze a (1,)-shaped scalar, as triton
    3.7+ does. Returns whether it patched (False: not interpreting, or not needed)."""
    import triton

    if not interpreting() or _version(triton.__version__) >= (3, 7):
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_radix_squeezes", False):
        return False

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._radix_squeezes = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
