"""The restricted loaders admit what torch's distributed checkpoint writes and refuse everything else."""

import io
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron_kl.run.safe_unpickle import UnsafePickle, restricted_checkpoint_reads, restricted_load


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_round_trips_and_a_payload_is_refused(tmp_path):
    meta = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                torch.Size([4, 2]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))],
            )
        },
        storage_data={MetadataIndex("w", torch.Size([0, 0])): filesystem._StorageInfo("__0_0.distcp", 0, 64)},
    )
    back = restricted_load(io.BytesIO(pickle.dumps(meta)))
    assert back.state_dict_metadata["w"].size == torch.Size([4, 2])
    assert back.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    marker = tmp_path / "pwned"
    for evil in (Payload(marker), {"ok": [Payload(marker)]}, eval):
        with pytest.raises(UnsafePickle, match="which a checkpoint never contains"):
            restricted_load(io.BytesIO(pickle.dumps(evil)), "x/.metadata")
    assert not marker.exists()


def test_the_loaders_are_swapped_only_inside_the_block(tmp_path):
    general_pickle, general_load_bytes = filesystem.pickle, default_planner.DefaultLoadPlanner.load_bytes
    marker = tmp_path / "pwned"
    with restricted_checkpoint_reads():
        assert filesystem.pickle is not general_pickle
        with pytest.raises(UnsafePickle):
            filesystem.pickle.load(io.BytesIO(pickle.dumps(Payload(marker))))
        planner = default_planner.DefaultLoadPlanner(flatten_state_dict=False)
        planner.state_dict = {}
        item = type("Item", (), {"dest_index": MetadataIndex("obj")})()
        payload = io.BytesIO()
        torch.save({"x": Payload(marker)}, payload)
        payload.seek(0)
        with pytest.raises(UnsafePickle, match="'obj'"):
            planner.load_bytes(item, payload)
        plain = io.BytesIO()
        torch.save({"x": torch.ones(2), "n": 3}, plain)
        plain.seek(0)
        planner.load_bytes(item, plain)
        assert planner.state_dict["obj"]["n"] == 3
    assert filesystem.pickle is general_pickle
    assert default_planner.DefaultLoadPlanner.load_bytes is general_load_bytes
    assert not marker.exists()
