"""Geometry in voxels, axis order (z, y, x): coordinates, boxes, halos, chunk grids, tasks.

Imports nothing else of znni; every type is immutable.
"""

from .blocks import block_starts, conv_blocks
from .coordinate import Coordinate, as_coordinate
from .grid import EDGE_POLICIES, Block, ChunkGrid, Halo, TaskGrid, create_blocks, output_bounds
from .roi import Roi

__all__ = [
    "EDGE_POLICIES",
    "Block",
    "ChunkGrid",
    "Coordinate",
    "Halo",
    "Roi",
    "TaskGrid",
    "as_coordinate",
    "block_starts",
    "conv_blocks",
    "create_blocks",
    "output_bounds",
]
