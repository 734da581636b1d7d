"""Block pool bookkeeping: free lists, owners, block tables. No tensors, no requests."""
from cache.block_pool import Allocation, BlockPool, PoolGeometry

__all__ = ["Allocation", "BlockPool", "PoolGeometry"]
