"""``PageEstimate``: how large an LMDB data file grows for records of given sizes.

The builder's disk-full message names the room the whole database needs; the
image bytes alone fall far short of it, as LMDB keeps a large record in whole
pages of its own.
"""

from __future__ import annotations

import math

__all__ = ["PageEstimate"]


class PageEstimate:
    """How many bytes of ``data.mdb`` the records written so far take, from their sizes.

    LMDB stores a small record in a leaf page (a 16-byte node header and key
    beside it, a 2-byte slot) and a large one in whole overflow pages of its
    own: a 5 KiB image takes 8 KiB. The builder appends, so leaf pages fill up
    in order; this follows that packing, then adds the branch pages, the two
    meta pages and the pages each commit copies. It errs on the high side, so
    that freeing the room it names is enough.
    """

    def __init__(self, page: int) -> None:
        self.page = page
        self.usable = page - 16  # the page header
        # LMDB's largest node kept in a leaf (me_nodemax), key and header included.
        self.node_max = ((self.usable // 2) & -2) - 2
        self.overflow_pages = 0
        self.leaf_pages = 0
        self.leaf_fill = self.usable  # no open leaf page yet
        self.commits = 0

    def add(self, size: int) -> None:
        node = 16 + size
        if node > self.node_max:  # its own overflow pages; a 24-byte node points to them
            self.overflow_pages += -(-(16 + size) // self.page)
            node = 16 + 8
        node += node & 1  # nodes are 2-byte aligned
        if self.leaf_fill + node + 2 > self.usable:
            self.leaf_pages += 1
            self.leaf_fill = 0
        self.leaf_fill += node + 2

    def bytes(self, scale: float = 1.0) -> int:
        """The file's size for these records, or ``scale`` times as many of them."""
        leaves = math.ceil(self.leaf_pages * scale)
        branches = math.ceil(leaves * 18 / self.usable) + 2  # 16-byte node + slot per leaf
        depth = 2 + math.ceil(math.log(max(leaves, 2), max(self.usable // 18, 2)))
        commits = math.ceil(self.commits * scale) + 2
        pages = math.ceil(self.overflow_pages * scale) + leaves + branches + 2  # 2 meta pages
        # Each commit writes a new copy of the tree's rightmost path; a freed page is
        # reused only two commits later, and the free list takes pages of its own.
        pages += commits * depth * 2
        return pages * self.page

    def record(self, size: int) -> int:
        """The bytes one more record of ``size`` bytes (the index) takes, with its commit."""
        return (-(-(16 + size) // self.page) + 4) * self.page
