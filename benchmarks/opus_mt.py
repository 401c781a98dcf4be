"""The translation rows of `make bench`: one OPUS-MT-shaped model (6 + 6 layers, d_model 512,
8 heads, d_ff 2048, a 58101-token vocabulary) with the same random weights in tformer
(imported from the MarianMTModel, as `tformer import` does it), in MarianMTModel itself,
and in CTranslate2 (its own converter run on the same saved directory).

Random weights translate random sources into outputs that run to the length limit, so every
side does the same number of decoding steps. The pad token's embedding is zero, as in real
OPUS-MT models: CTranslate2 starts the decoder from a zero vector instead of reading it.

Run on its own, it builds the sides and checks what speed.py and decode_paths.py check
before they time anything: tformer and MarianMTModel find the same beam-4 tokens.

    python benchmarks/opus_mt.py [--batches 1 16] [--len 30]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

VOCAB = 58101
SHAPE = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
             decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)
EOS, UNK, PAD = 0, 1, VOCAB - 1


def _sentencepiece(path: Path) -> list[str]:
    """A small SentencePiece model (MarianTokenizer and the converter need one); its pieces."""
    import io

    import sentencepiece as spm

    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 7)))
             for _ in range(400)]
    lines = [" ".join(rng.choices(words, k=10)) for _ in range(500)]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=proto,
                                   vocab_size=300, minloglevel=2)
    path.write_bytes(proto.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    return [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]


def opus_mt_dir(path: Path) -> Path:
    """A random OPUS-MT-shaped MarianMTModel and its tokenizer files, saved at `path`."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    path.mkdir(parents=True, exist_ok=True)
    pieces = _sentencepiece(path / "source.spm")
    (path / "target.spm").write_bytes((path / "source.spm").read_bytes())
    vocab = {"</s>": EOS, "<unk>": UNK}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    while len(vocab) < PAD:
        vocab[f"\u2581w{len(vocab)}"] = len(vocab)
    vocab["<pad>"] = PAD
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    MarianTokenizer(str(path / "source.spm"), str(path / "target.spm"),
                    str(path / "vocab.json")).save_pretrained(path)
    config = MarianConfig(
        vocab_size=VOCAB, max_position_embeddings=512, activation_function="swish",
        scale_embedding=True, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
        forced_eos_token_id=EOS, bad_words_ids=[[PAD]], dropout=0.0, **SHAPE,
    )
    torch.manual_seed(0)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        model.model.shared.weight[PAD].zero_()
    model.save_pretrained(path)
    return path


class Sides:
    """The same model four ways: tformer fp32 (prepacked, as `tformer translate` runs it)
    and int8, MarianMTModel, and CTranslate2 translators in float32 and int8."""

    def __init__(self, threads: int, work_dir: Path | None = None) -> None:
        import ctranslate2
        from transformers import MarianMTModel

        from tformer.interop import read_hf_config, read_hf_weights
        from tformer.interop.marian import seq2seq_from_hf
        from tformer.kernels.formats import quantize_model
        from tformer.kernels.prepack import prepack

        self._tmp = None if work_dir else tempfile.TemporaryDirectory()
        root = Path(work_dir or self._tmp.name)
        src = opus_mt_dir(root / "hf")
        self.peer = MarianMTModel.from_pretrained(src).eval()
        ours = seq2seq_from_hf(read_hf_config(src), read_hf_weights(src), src)
        self.ours = prepack(ours)
        self.ours_int8 = quantize_model(ours, "int8")
        ct2_dir = root / "ct2"
        ctranslate2.converters.TransformersConverter(str(src)).convert(str(ct2_dir), force=True)
        self.ct2 = {kind: ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=kind,
                                                 intra_threads=threads, inter_threads=1)
                    for kind in ("float32", "int8")}
        self.pieces = {i: p for p, i in json.loads((src / "vocab.json").read_text()).items()}

    def sources(self, batch: int, length: int = 20) -> torch.Tensor:
        g = torch.Generator().manual_seed(batch)
        src = torch.randint(2, VOCAB - 1, (batch, length), generator=g)
        src[:, -1] = EOS
        return src

    def tformer(self, src: torch.Tensor, max_len: int, int8: bool = False) -> list[list[int]]:
        from tformer.decoding.beam import beam_search

        model = self.ours_int8 if int8 else self.ours
        found = beam_search(model, src, torch.ones_like(src, dtype=torch.bool), beam=4,
                            bos_id=PAD, eos_id=EOS, pad_id=PAD, alpha=1.0, penalty="hf",
                            max_len_a=0.0, max_len_b=max_len)
        return [h[0].tokens for h in found]

    def marian(self, src: torch.Tensor, max_len: int) -> list[list[int]]:
        out = self.peer.generate(src, attention_mask=torch.ones_like(src), num_beams=4,
                                 max_length=max_len + 1, length_penalty=1.0,
                                 early_stopping=False)
        return [[int(t) for t in row[1:] if int(t) not in (EOS, PAD)] for row in out]

    def ctranslate2(self, src: torch.Tensor, max_len: int, int8: bool = False) -> list:
        tokens = [[self.pieces[int(t)] for t in row] for row in src]
        return self.ct2["int8" if int8 else "float32"].translate_batch(
            tokens, beam_size=4, max_decoding_length=max_len, length_penalty=1.0,
            max_batch_size=0,
        )

    def check_same_tokens(self, batch: int, max_len: int) -> None:
        """tformer and MarianMTModel must agree before anything is timed."""
        src = self.sources(batch)
        with torch.no_grad():
            if self.tformer(src, max_len) != self.marian(src, max_len):
                raise SystemExit(f"opus-mt beam 4 batch {batch}: tformer and MarianMTModel "
                                 f"disagree; not timing different work")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--len", type=int, default=30, help="output tokens per sentence")
    args = parser.parse_args()
    sides = Sides(torch.get_num_threads())
    for batch in args.batches:
        sides.check_same_tokens(batch, args.len)
        print(f"batch {batch}: tformer and MarianMTModel find the same {args.len} tokens")


if __name__ == "__main__":
    main()
