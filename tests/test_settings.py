"""The typed configuration: its records keep the schema's keys, and a checked config round-trips."""

import dataclasses

import pytest

from znni_core.errors import ConfigError
from znni_core.pipeline.settings import (
    Config,
    MaskSettings,
    load_config,
    parse_config,
    schema,
    sections,
    validate_config,
)

MINIMAL = {
    "input": {"path": "file:///em", "dtype": "uint8"},
    "network": {"path": "net.onnx"},
    "output": {"path": "file:///out"},
}


def test_every_record_has_exactly_its_schema_sections_keys():
    for record, properties in sections().items():
        fields = {f.name for f in dataclasses.fields(record)}
        assert fields == set(properties), record.__name__
    # every section of the schema with keys of its own is a record
    with_keys = {name for name, sub in schema()["properties"].items() if "properties" in sub}
    assert len(with_keys) == 12 and len(sections()) == 1 + len(with_keys)


def test_a_checked_config_round_trips_through_the_record():
    full = {
        **MINIMAL,
        "mask": {"path": "file:///mask", "mip": 2},
        "region": {"offset": [1, 2, 3], "shape": [4, 5, 6]},
        "output": {"path": "file:///out", "dtype": "uint8", "scale": 2.5, "sharding": {"@type": "x"}},
        "tta": {"flips": ["x"], "variance": True},
        "jobs": {"tasks_per_job": 7},
        "task_chunks": [1, 2, 2],
    }
    for doc in (MINIMAL, full):
        checked = validate_config(doc)
        cfg = parse_config(doc)
        assert cfg.to_dict() == checked  # what run.json records and the run's digest covers
        assert parse_config(cfg.to_dict()) == cfg
    cfg = parse_config(full)
    assert cfg.mask == MaskSettings("file:///mask", 2, None, None, "fail")
    assert (cfg.region.offset, cfg.output.scale, cfg.output.sharding) == ([1, 2, 3], 2.5, {"@type": "x"})
    assert (cfg.tta.on, cfg.jobs.tasks_per_job, cfg.jobs.minutes) == (True, 7, 30)
    assert parse_config(MINIMAL).mask is None and "mask" not in parse_config(MINIMAL).to_dict()
    assert parse_config(cfg) is cfg


def test_records_are_frozen_and_bad_configs_are_refused_naming_the_key(tmp_path):
    cfg = parse_config(MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.output.dtype = "uint8"
    with pytest.raises(ConfigError, match="output.chunk_size"):
        parse_config({**MINIMAL, "output": {"path": "file:///out", "chunk_size": [0, 8, 8]}})
    path = tmp_path / "config.yaml"
    path.write_text("input: {path: file:///em, dtype: uint8}\nnetwork: {path: n.onnx}\noutput: {path: file:///o}\n")
    assert isinstance(load_config(path), Config) and load_config(path).input.missing == "fail"
