#!/usr/bin/env python3
"""Writes the committed seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/), from the
tiny Z-Image and Flux fixtures (tests/fixtures/zimage_tiny, tests/fixtures/flux_tiny) plus small
hand-made and a few broken inputs each. Deterministic; run from anywhere:
/usr/bin/python3 tests/fuzz/make_seed_corpus.py"""

import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "zimage_tiny", "pipeline")
FLUX_FIXTURES = os.path.join(HERE, "..", "fixtures", "flux_tiny", "pipeline")


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


def flux_read(*path):
    with open(os.path.join(FLUX_FIXTURES, *path), "rb") as f:
        return f.read()


def clip_tokenizer_seeds():
    # clip_tokenizer_fuzzer's input: vocab.json, a NUL byte, merges.txt.
    def pair(vocab, merges):
        vocab = vocab if isinstance(vocab, bytes) else json.dumps(vocab, ensure_ascii=False).encode()
        return vocab + b"\0" + (merges if isinstance(merges, bytes) else merges.encode())

    vocab, merges = flux_read("tokenizer", "vocab.json"), flux_read("tokenizer", "merges.txt")
    seeds = {"fixture": pair(vocab, merges)}
    small = {}
    for c in "acehlost'":
        small[c] = len(small)
        small[c + "</w>"] = len(small)
    for merged in ["he", "ll", "lo</w>", "hell", "hello</w>", "th", "the</w>", "ca", "cat</w>", "'s</w>"]:
        small[merged] = len(small)
    small["<|startoftext|>"] = len(small)
    small["<|endoftext|>"] = len(small)
    small_merges = "#version: 0.2\nh e\nl o</w>\nl l\nhe ll\nhell o</w>\nt h\nth e</w>\nc a\nca t</w>\n' s</w>\n"
    seeds["small"] = pair(small, small_merges)
    seeds["small_crlf_no_version_repeats"] = pair(small, "l l\r\nh e\r\nl l\r\nhe ll\r\n")
    seeds["vocab_only"] = json.dumps(small).encode()
    seeds["broken_merge_line"] = pair(small, "#version: 0.2\nh e\nh  e\nl\n")
    seeds["broken_merge_unknown"] = pair(small, "#version: 0.2\nq x\n")
    broken = dict(small)
    broken["h"] = 1.5
    seeds["broken_fractional_id"] = pair(broken, small_merges)
    broken = dict(small)
    del broken["<|startoftext|>"]
    seeds["broken_no_bos"] = pair(broken, small_merges)
    seeds["broken_nested"] = pair(b'{"a":{"b":1}}', small_merges)
    seeds["broken_deep"] = pair(b"[" * 64, b"")
    return seeds


# The protobuf wire format, for spiece.model seeds.
def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out += bytes([byte | 0x80])
        else:
            return out + bytes([byte])


def field_bytes(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data


def field_varint(number, value):
    return varint(number << 3) + varint(value)


def field_float(number, value):
    return varint(number << 3 | 5) + struct.pack("<f", value)


def read_fields(data):
    """(number, wire type, raw field bytes) of each field of a message."""
    out, i = [], 0
    while i < len(data):
        start = i

        def take_varint():
            nonlocal i
            value, shift = 0, 0
            while True:
                byte = data[i]
                i += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    return value

        key = take_varint()
        wire = key & 7
        if wire == 0:
            take_varint()
        elif wire == 1:
            i += 8
        elif wire == 2:
            length = take_varint()
            i += length
        elif wire == 5:
            i += 4
        out.append((key >> 3, wire, data[start:i]))
    return out


# SentencePiece's piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def spiece(pieces, trainer=b"", normalizer=b""):
    """A ModelProto: pieces (text, score, type), trainer_spec and normalizer_spec bodies."""
    out = b""
    for text, score, kind in pieces:
        body = field_bytes(1, text.encode() if isinstance(text, str) else text) + field_float(2, score)
        if kind != NORMAL:
            body += field_varint(3, kind)
        out += field_bytes(1, body)
    out += field_bytes(2, field_varint(3, 1) + trainer)  # model_type UNIGRAM
    return out + field_bytes(3, normalizer)


def charsmap(rules):
    """A precompiled normalisation table (Darts-clone double array + NUL-terminated replacements)
    for `rules` {source: replacement}, checked by walking it as T5Tokenizer does."""
    strings, value_of = b"", {}
    for src, dst in sorted(rules.items()):
        value_of[src.encode()] = len(strings)
        strings += dst.encode() + b"\0"
    trie = {}  # A byte trie: node = dict of children, key None = value.
    for key, value in value_of.items():
        node = trie
        for b in key:
            node = node.setdefault(b, {})
        node[None] = value
    units, used_bases = {0: 0}, set()

    def place(node, index):
        labels = sorted(b for b in node if b is not None)
        base = 1
        while base in used_bases or any((base ^ c) in units or (base ^ c) == 0 for c in labels) or \
                (None in node and base in units):
            base += 1
        used_bases.add(base)
        offset = index ^ base
        assert offset < (1 << 21)
        units[index] = units.get(index, 0) | offset << 10 | ((1 << 8) if None in node else 0)
        if None in node:
            units[base] = 1 << 31 | node[None]
        for c in labels:
            units[base ^ c] = c
        for c in labels:
            place(node[c], base ^ c)

    place(trie, 0)
    array = [units.get(i, 0) for i in range(max(units) + 1)]

    def longest(text):
        node, length, value = array[0] >> 10, 0, None
        for i, c in enumerate(text):
            node ^= c
            if node >= len(array) or (array[node] & (1 << 31 | 0xFF)) != c:
                break
            unit = array[node]
            node ^= unit >> 10
            if unit >> 8 & 1:
                length, value = i + 1, array[node] & ((1 << 31) - 1)
        return length, value

    for key, value in value_of.items():
        assert longest(key + b"\xff") == (len(key), value), key
    trie_bytes = struct.pack("<%dI" % len(array), *array)
    return struct.pack("<I", len(trie_bytes)) + trie_bytes + strings


def t5_tokenizer_seeds():
    fixture = flux_read("tokenizer_2", "spiece.model")
    seeds = {"fixture": fixture}
    # The fixture without its 240 kB NFKC table: its pieces and specs, normalizer_spec's name only.
    no_table = b"".join(raw for number, _, raw in read_fields(fixture) if number != 3)
    no_table += field_bytes(3, field_bytes(1, b"nmt_nfkc"))
    seeds["fixture_without_table"] = no_table
    special = [("<pad>", 0.0, CONTROL), ("</s>", 0.0, CONTROL), ("<unk>", 0.0, UNKNOWN)]
    normal = [("\u2581", -2.0, NORMAL), ("\u2581a", -3.0, NORMAL), ("a", -3.5, NORMAL), ("t", -4.0, NORMAL),
              ("\u2581the", -4.5, NORMAL), ("he", -5.0, NORMAL), ("cat", -5.5, NORMAL), ("s", -6.0, NORMAL),
              ("\u65e5", -7.0, NORMAL), ("fi", -7.5, NORMAL), ("A", -8.0, NORMAL)]
    table = charsmap({"\uff21": "A", "\ufb01": "fi", "\u3000": " ", "\u00a0": " ", "\u200b": "",
                      "\u2460": "1", "e\u0301": "\u00e9", "\t": " "})
    seeds["small_with_table"] = spiece(special + normal, normalizer=field_bytes(2, table))
    # Byte fallback with all 256 byte pieces, user-defined symbols, no dummy prefix, whitespace kept
    # and as a suffix, no table.
    byte_pieces = [("<0x%02X>" % b, 0.0, BYTE) for b in range(256)]
    user = [("<sep>", 0.0, USER_DEFINED), ("lantern", 0.0, USER_DEFINED), ("\u2603", 0.0, USER_DEFINED),
            ("unused", -1.0, UNUSED)]
    seeds["small_byte_fallback"] = spiece(
        special + byte_pieces + user + normal,
        trainer=field_varint(24, 1) + field_varint(35, 1),
        normalizer=field_varint(3, 0) + field_varint(4, 0))
    seeds["small_no_escape"] = spiece(special + normal, normalizer=field_varint(5, 0))
    seeds["broken_truncated"] = no_table[:len(no_table) // 2 + 1]
    seeds["broken_default_ids"] = spiece([("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL),
                                          ("</s>", 0.0, CONTROL)] + normal)
    seeds["broken_bpe"] = spiece(special + normal, trainer=field_varint(3, 2))
    seeds["broken_duplicate_piece"] = spiece(special + normal + [("cat", -9.0, NORMAL)])
    seeds["broken_byte_without_fallback"] = spiece(special + byte_pieces + normal)
    seeds["broken_table_truncated"] = spiece(special + normal,
                                             normalizer=field_bytes(2, b"\xff\xff\x00\x00" + b"12345678"))
    seeds["broken_varint"] = b"\x0a" + b"\xff" * 11
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
    write("clip_tokenizer", clip_tokenizer_seeds())
    write("t5_tokenizer", t5_tokenizer_seeds())
