"""Execution: a plan run on one patch (one executor for every network), tiling and blending of patches, devices, streams."""
