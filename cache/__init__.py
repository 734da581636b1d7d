"""Block pool bookkeeping: free lists, owners, block tables. No tensors, no requests."""
from tandem.cache.block_pool import Allocation, BlockPool, Placement, PoolGeometry

__all__ = ["Allocation", "BlockPool", "Placement", "PoolGeometry"]
