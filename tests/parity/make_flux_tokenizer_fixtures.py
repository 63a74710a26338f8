"""Writes parity fixtures for the C++ tokenizers of Flux.1's pipeline (models/tokenizers/clip_tokenizer.h,
models/tokenizers/t5_tokenizer.h) from transformers' own tokenizer classes.

Run on the GPU host (transformers, tokenizers, sentencepiece and protobuf installed; no network
needed), from the repository root:

    python3 tests/parity/make_flux_tokenizer_fixtures.py tests/fixtures/flux_tokenizers

It writes
  clip/      vocab.json, merges.txt (a small byte-level BPE trained by the tokenizers library in
             CLIP's configuration, laid out as openai/clip-vit-large-patch14's: the 256 byte symbols,
             the same with "</w>", the merges' results, <|startoftext|>, <|endoftext|>), and
             tokenizer_config.json as Flux's tokenizer/ folder has one (no tokenizer.json, as there);
  t5/        spiece.model (a small SentencePiece Unigram model with T5's special ids, trained by the
             sentencepiece package), tokenizer.json converted from it the way transformers converts
             T5's (as the published tokenizer_2/ folder carries one), tokenizer_config.json;
  expected.json  for held-out strings (long prompts past the cut, punctuation, non-Latin scripts,
             emoji, mixed case, whitespace runs): the ids of transformers' CLIPTokenizer (as
             diffusers' FluxPipeline loads it: padding="max_length", truncation=True, max_length 77)
             and of T5TokenizerFast and T5Tokenizer (max_length 32 and 512), plus sentencepiece's own
             ids (+ </s>, cut, padded) for reference, and the versions used.
The C++ side, //tests/fixtures:flux_tokenizer_parity_test (tests/parity/flux_tokenizer_parity_test.cc),
exists once this folder is committed and compares every id exactly.

The script stops (exit status 1) when transformers evidently did not use the files (ids of plain
English text with no merged CLIP token, or T5 ids that differ from sentencepiece's on plain text),
rather than writing fixtures from a tokenizer that ignored its vocabulary.
"""

import json
import os
import shutil
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from make_zimage_random_dir import byte_symbols  # noqa: E402  GPT-2's byte -> printable character table.

CLIP_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""

# Training text: prompts of the kind Flux gets, a few other scripts, repeated so that merges and
# pieces form. The held-out strings below are not in it.
CORPUS = [
    "a photo of an astronaut riding a horse on the moon, highly detailed",
    "a red lantern hanging in a dark alley at night, cinematic lighting",
    "portrait of a woman with long red hair, oil painting, soft light",
    "a bowl of fruit on a wooden table: apples, pears, grapes and a lemon",
    "the quick brown fox jumps over the lazy dog near the river bank",
    "A cat sitting on a mat, looking at the camera, 35mm photograph",
    "an old lighthouse on a rocky coast during a storm, waves crashing",
    "futuristic city skyline at sunset with flying cars and neon signs",
    "a watercolor painting of a mountain lake with pine trees",
    "close-up of a hummingbird drinking nectar from a flower",
    "it's a dog's life; we're here, they'd go, I'll stay, you've seen",
    "numbers like 1024, 768, 3.14 and 2024 appear in prompts",
    "café au lait, naïve art, crème brûlée, jalapeño, façade",
    "Привет, это пример текста на русском языке",
    "日本語のテキストと漢字のプロンプト、猫と犬",
    "中文提示词：一只可爱的猫坐在窗台上",
    "Ελληνικά γράμματα και λέξεις",
    "emoji 😀 and 👍 and 🐱 in a sentence",
]

HELD_OUT = [
    "",
    "a red lantern",
    "A Photo of TWO cats,  sitting on a mat!",
    "A PhOtO oF a HoRsE, MiXeD CaSe",
    "  leading and trailing spaces  ",
    "whitespace\truns\n\nnewlines   and\u00a0no-break\u3000ideographic spaces",
    "punctuation!!! (really?) -- yes... 'quoted' \"double\" [brackets] {braces} a/b\\c #hash @at",
    "it's we're they'd I'LL you've she's can't",
    "digits 1234567890 and 3.14159 and 1920x1080",
    "café naïve e\u0301 résumé ÉCOLE",
    "Привет мир, ЗАГЛАВНЫЕ буквы",
    "日本語のテキスト、東京タワー",
    "中文提示词：夕阳下的城市",
    "한국어 문장입니다",
    "العربية نص قصير",
    "Ελληνικά ΣΊΣΥΦΟΣ",
    "नमस्ते दुनिया",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ☃",
    "İstanbul and ß and ﬁ ligature",
    "ＦＵＬＬＷＩＤＴＨ ｌｅｔｔｅｒｓ １２３",
    "zero\u200bwidth and soft\u00adhyphen",
    "a photo <|endoftext|> of a cat",
    " ".join(["an extremely long prompt describing a very detailed fantasy landscape with castles"] * 12),
    "word " * 100,
]

CLIP_LENGTHS = (77, 10)
T5_LENGTHS = (512, 32)


def fail(message):
    print("make_flux_tokenizer_fixtures:", message, file=sys.stderr)
    sys.exit(1)


def clip_fixture(out):
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    directory = os.path.join(out, "clip")
    os.makedirs(directory, exist_ok=True)
    # Training in CLIP's configuration (the tokenizers pipeline transformers 5 builds for CLIP).
    trainer_tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    trainer_tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(CLIP_PATTERN), behavior="removed", invert=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), end_of_word_suffix="</w>")
    trainer_tok.train_from_iterator(CORPUS * 20, trainer)
    merges = []
    for m in json.loads(trainer_tok.to_str())["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        merges.append((a, b))
    symbols = [byte_symbols()[b] for b in range(256)]
    vocab = symbols + [s + "</w>" for s in symbols]
    seen = set(vocab)
    for a, b in merges:
        if a not in seen or b not in seen:
            fail(f"merge {a!r} {b!r} uses a symbol outside the vocabulary")
        if a + b not in seen:
            vocab.append(a + b)
            seen.add(a + b)
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    ids = {t: i for i, t in enumerate(vocab)}
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(ids, f, ensure_ascii=False)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "bos_token": "<|startoftext|>",
              "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "do_lower_case": True, "errors": "replace"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)

    tok = CLIPTokenizer.from_pretrained(directory)  # As diffusers loads tokenizer/.
    probe = tok("a photo of an astronaut riding a horse", add_special_tokens=False).input_ids
    if not any(512 <= i < ids["<|startoftext|>"] for i in probe):
        fail(f"CLIPTokenizer used no merge on plain English ({probe}): did it read vocab.json/merges.txt?")
    cases = []
    for text in HELD_OUT:
        for max_length in CLIP_LENGTHS:
            cases.append({"text": text, "max_length": max_length,
                          "ids": tok(text, padding="max_length", max_length=max_length, truncation=True).input_ids})
    return {"dir": "clip", "class": f"{type(tok).__module__}.{type(tok).__qualname__}",
            "bases": [c.__name__ for c in type(tok).__mro__], "merges": len(merges), "cases": cases}


def t5_tokenizer_json(model_path, directory):
    """tokenizer.json from spiece.model through transformers' T5Converter (what wrote the published
    tokenizer_2/tokenizer.json); if this transformers has no usable converter, the same pipeline
    built by hand. Returns how it was made."""
    try:
        from transformers.convert_slow_tokenizer import T5Converter

        shim = types.SimpleNamespace(vocab_file=model_path, _extra_ids=0, eos_token="</s>", eos_token_id=1,
                                     unk_token="<unk>", pad_token="<pad>", legacy=True, add_prefix_space=True,
                                     all_special_tokens=["</s>", "<unk>", "<pad>"], additional_special_tokens=[])
        tokenizer = T5Converter(shim).converted()
        how = "transformers.convert_slow_tokenizer.T5Converter"
    except Exception as e:  # noqa: BLE001 (any failure of the shim: build it by hand)
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

        proto = sentencepiece_model_pb2.ModelProto()
        with open(model_path, "rb") as f:
            proto.ParseFromString(f.read())
        tokenizer = Tokenizer(models.Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=2,
                                             byte_fallback=False))
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap),
             normalizers.Replace(Regex(" {2,}"), " ")])
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(),
             pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)])
        tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
        how = f"built by hand (T5Converter failed: {type(e).__name__}: {e})"
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return how


def t5_fixture(out, work):
    import sentencepiece as spm

    directory = os.path.join(out, "t5")
    os.makedirs(directory, exist_ok=True)
    corpus = os.path.join(work, "t5_corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(20):
            f.write("\n".join(CORPUS) + "\n")
    prefix = os.path.join(work, "spiece")
    # T5's layout: <pad> 0, </s> 1, <unk> 2, no <s>; nmt_nfkc normalisation (the trainer's default,
    # and T5's); coverage below 1 so that rare characters are <unk>.
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=400, model_type="unigram",
                                   hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   character_coverage=0.995, num_threads=1, normalization_rule_name="nmt_nfkc")
    model_path = os.path.join(directory, "spiece.model")
    shutil.copyfile(prefix + ".model", model_path)
    how = t5_tokenizer_json(model_path, directory)
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": 512, "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>", "extra_ids": 0, "additional_special_tokens": [],
              "legacy": True}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)

    sp = spm.SentencePieceProcessor(model_file=model_path)
    from transformers import T5Tokenizer
    try:
        from transformers import T5TokenizerFast
    except ImportError:
        T5TokenizerFast = None
    fast = (T5TokenizerFast or T5Tokenizer).from_pretrained(directory)  # As diffusers loads tokenizer_2/.
    slow = T5Tokenizer.from_pretrained(directory)
    plain = "a photo of an astronaut riding a horse"
    if fast(plain).input_ids != sp.encode(plain) + [1]:
        fail(f"T5TokenizerFast gives {fast(plain).input_ids} for {plain!r}, sentencepiece "
             f"{sp.encode(plain) + [1]}: did it read spiece.model / tokenizer.json?")

    def framed(ids, max_length):
        ids = ids[: max_length - 1] + [1]
        return ids + [0] * (max_length - len(ids))

    cases = []
    for text in HELD_OUT:
        for max_length in T5_LENGTHS:
            kwargs = dict(padding="max_length", max_length=max_length, truncation=True)
            cases.append({"text": text, "max_length": max_length, "ids": fast(text, **kwargs).input_ids,
                          "slow_ids": slow(text, **kwargs).input_ids,
                          "sentencepiece_ids": framed(sp.encode(text), max_length)})
    return {"dir": "t5", "tokenizer_json": how,
            "fast_class": f"{type(fast).__module__}.{type(fast).__qualname__}",
            "slow_class": f"{type(slow).__module__}.{type(slow).__qualname__}",
            "pieces": sp.get_piece_size(), "cases": cases}


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    work = os.path.join(out, ".work")
    os.makedirs(work, exist_ok=True)
    import sentencepiece
    import tokenizers
    import transformers

    expected = {"versions": {m.__name__: m.__version__ for m in (transformers, tokenizers, sentencepiece)},
                "clip": clip_fixture(out), "t5": t5_fixture(out, work)}
    shutil.rmtree(work)
    differ = [c["text"][:40] for c in expected["t5"]["cases"] if c["ids"] != c["sentencepiece_ids"]]
    expected["t5"]["texts_where_transformers_and_sentencepiece_differ"] = differ
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
    print("fixtures written to", out, "with", expected["versions"], "; T5 tokenizer.json:",
          expected["t5"]["tokenizer_json"], "; transformers and sentencepiece differ on", len(differ), "T5 cases")


if __name__ == "__main__":
    main()
