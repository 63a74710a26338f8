#!/usr/bin/env python3
"""Writes the committed seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/), from the
tiny Z-Image fixtures (tests/fixtures/zimage_tiny) plus a few broken inputs each. Deterministic; run
from anywhere: /usr/bin/python3 tests/fuzz/make_seed_corpus.py"""

import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "zimage_tiny", "pipeline")


def image(header, data=b""):
    if isinstance(header, (dict, list)):
        header = json.dumps(header, separators=(",", ":"))
    header = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(header)) + header + data


def safetensors_seeds():
    seeds = {}
    seeds["valid_two_tensors"] = image(
        {"__metadata__": {"format": "pt"},
         "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
         "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}, bytes(22))
    seeds["valid_empty_and_scalar"] = image(
        {"e": {"dtype": "I64", "shape": [0, 7], "data_offsets": [0, 0]},
         "s": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}}, bytes(1))
    seeds["valid_every_dtype"] = image(
        {d: {"dtype": d, "shape": [1], "data_offsets": [i * 8, i * 8 + n]}
         for i, (d, n) in enumerate([("F32", 4), ("BF16", 2), ("F16", 2), ("F64", 8), ("I64", 8), ("I32", 4),
                                     ("U8", 1), ("I8", 1), ("BOOL", 1)])}, bytes(72))
    # The real VAE fixture's header (its data cut off: offsets beyond the data section).
    with open(os.path.join(FIXTURES, "vae", "diffusion_pytorch_model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        seeds["fixture_vae_header_no_data"] = struct.pack("<Q", n) + f.read(n)
    seeds["broken_span_mismatch"] = image({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4))
    seeds["broken_overlap"] = image({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                     "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, bytes(8))
    seeds["broken_overflow_shape"] = image(
        '{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}', bytes(8))
    seeds["broken_fractional_dim"] = image('{"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}}', bytes(1))
    seeds["broken_deep"] = image("[" * 64)
    seeds["broken_length"] = struct.pack("<Q", 1 << 40) + b"{}"
    seeds["broken_json"] = image('{"a":{"dtype":"F32",,}}')
    return seeds


def read(*path):
    with open(os.path.join(FIXTURES, *path), "rb") as f:
        return f.read()


def config_seeds():
    seeds = {
        "transformer": read("transformer", "config.json"),
        "vae": read("vae", "config.json"),
        "text_encoder": read("text_encoder", "config.json"),
        "scheduler": read("scheduler", "scheduler_config.json"),
        "model_index": read("model_index.json"),
        "tiny_text_encoder": b'{"_class_name":"TinyTextEncoder","vocab_size":259,"max_tokens":128,"dim":64,"heads":4,"layers":2}',
        "tiny_dit": b'{"_class_name":"TinyDiT","in_channels":4,"patch_size":2,"dim":96,"heads":4,"layers":4,'
                    b'"text_dim":64,"mlp_ratio":4,"timestep_dim":256}',
        "tiny_vae": b'{"_class_name":"TinyVaeDecoder","latent_channels":4,"groups":8,"scaling_factor":1.0,'
                    b'"shift_factor":0.0,"block_out_channels":[64,48,32,32]}',
    }
    transformer = json.loads(seeds["transformer"])
    for field, value in [("n_heads", 0), ("dim", 1 << 40), ("axes_dims", [8, 12, 14]), ("all_patch_size", [0])]:
        broken = dict(transformer)
        broken[field] = value
        seeds[f"broken_transformer_{field}"] = json.dumps(broken).encode()
    vae = json.loads(seeds["vae"])
    vae["norm_num_groups"] = 0
    seeds["broken_vae_groups"] = json.dumps(vae).encode()
    seeds["broken_deep"] = b'{"a":' + b"[" * 64 + b"}"
    seeds["broken_types"] = b'{"dim":"64","n_heads":2.5,"qk_norm":1,"norm_eps":"x"}'
    return seeds


def tokenizer_seeds():
    fixture = read("tokenizer", "tokenizer.json")
    seeds = {"fixture": fixture}
    small = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
             "added_tokens": [{"content": "<|im_end|>", "id": 3}]}
    seeds["small_bpe"] = json.dumps(small).encode()
    broken = json.loads(fixture)
    broken["pre_tokenizer"] = {"type": "Sequence"}
    seeds["broken_sequence"] = json.dumps(broken).encode()
    broken = json.loads(fixture)
    broken["model"]["merges"] = ["nospace", ["a", 5]]
    seeds["broken_merges"] = json.dumps(broken).encode()
    broken = dict(small)
    broken["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+$"}}
    seeds["backtracking_regex"] = json.dumps(broken).encode()
    seeds["broken_deep"] = b'{"model":' + b"[" * 64 + b"}"
    return seeds


def write(target, seeds):
    out = os.path.join(HERE, "corpus", target)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for name, data in sorted(seeds.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    write("safetensors", safetensors_seeds())
    write("model_config", config_seeds())
    write("tokenizer", tokenizer_seeds())
