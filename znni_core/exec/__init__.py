"""Execution: a plan run on one patch (chain and graph engines), tiling and blending of patches, devices, streams."""
