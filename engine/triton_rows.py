"""The Triton side of engine.triton_paging: a context token's pool row inside a kernel.

Kept apart from engine.triton_paging (which the runner imports to build tables) because Triton
fixes at definition whether a function is compiled or interpreted: every jit function here is
defined together with the kernels that call it, when the first kernel module is imported.
"""
import triton
import triton.language as tl


@triton.jit
def token_rows(tab_ptr, dir_ptr, req, t, valid, stride_tab, stride_dir,
               B: tl.constexpr, ROWS: tl.constexpr, COL: tl.constexpr = 0,
               STRIDE_COL: tl.constexpr = 1):
    """Pool rows of logical tokens ``t`` (a vector) of request ``req``: through the row table
    when ROWS, else the block table and directions (engine.triton_paging). COL picks one of a
    hidden cache's m rows."""
    if ROWS:
        rows = tl.load(tab_ptr + req * stride_tab + t * STRIDE_COL + COL, mask=valid, other=0)
    else:
        blk_i = t // B
        off = t % B
        blk = tl.load(tab_ptr + req * stride_tab + blk_i * STRIDE_COL + COL, mask=valid, other=0)
        right = tl.load(dir_ptr + req * stride_dir + blk_i, mask=valid, other=0)
        rows = blk * B + tl.where(right != 0, B - 1 - off, off)
    return rows.to(tl.int64)


def interpreted(kernel) -> bool:
    """Whether ``kernel`` runs under Triton's interpreter (defined with TRITON_INTERPRET=1):
    its products of bf16/fp16 tiles are wrong there, so the kernels multiply in fp32."""
    return type(kernel).__name__ == "InterpretedFunction"
