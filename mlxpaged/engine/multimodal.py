"""A request's images: processed once when it is added, fed to its prompt rows in each pass.

`process_images` runs mlx-vlm's processor on the images (each image's one marker widened to what
the processor makes of it: its image tokens, with any text tokens around or between them, as
mlx-vlm's `generate` does), `encode_images` and the model's `get_input_embeddings`
on the whole prompt (models/vision.py), and keeps what the passes need: the features of the
image-token rows, each prompt token's 3-D position (Qwen's multimodal RoPE) and the delta decode
positions continue from, and each image's content hash with the rows it fills. The model's
`pass_rows` (models/vision.py) reads them for each pass.

A prompt holds its features only until its image rows are prefilled: the pass that feeds the last
one drops them (`PromptImages.take`). A prompt that computes its image rows again (after a
preemption) gets them back from the encoder cache, or from the vision tower on the smaller of its
processed pixel inputs and its decoded images (`encode_prompt_images`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np


def image_digest(image) -> bytes:
    """The content hash of a decoded image (PIL): its mode, size and pixels, so the same picture
    in another file format or name is the same image."""
    h = hashlib.sha256()
    h.update(f"{image.mode}|{image.size}".encode())
    h.update(image.tobytes())
    return h.digest()


@dataclass(eq=False)
class PromptImages:
    """One prompt's images, as its passes need them.

    Invariants: `rows` are the prompt positions of its image tokens, ascending; `held`, while the
    prompt has image rows to prefill, is `(features, deepstack)`: `features[k]` the embedding row
    mlx-vlm merged at `rows[k]`, `deepstack` `[layers, K, hidden]` the features some layers add
    again (Qwen3-VL) or None; it is None once the last image row was fed (`take`), and `refill`
    makes it again when a recompute needs it. `spans[i] = (start, end, digest)` is image i's token
    rows `[start, end)` and its content hash (`image_digest`), in prompt order; `positions` (None
    for a family with 1-D positions) is `[3, P]`, each prompt token's t/h/w position, and a token
    at position p >= P (generated) is at `p + delta` in all three; `num_image_tokens == len(rows)`.
    Shared by a request's samples and beams (only its carrier prefills the prompt).
    """

    rows: np.ndarray  # [K] int64
    held: tuple | None  # (features [K, hidden], deepstack or None) until the image rows are prefilled
    spans: tuple[tuple[int, int, bytes], ...]
    positions: np.ndarray | None  # [3, P] int32
    delta: int = 0
    refill: Callable[[], tuple] | None = None  # the features again (`encode_prompt_images`)
    num_refills: int = 0

    @property
    def num_image_tokens(self) -> int:
        return len(self.rows)

    @property
    def last_row(self) -> int:
        """The prompt position of the last image token (-1: none)."""
        return int(self.rows[-1]) if len(self.rows) else -1

    @property
    def nbytes(self) -> int:
        """Bytes of the features held now (0 once dropped)."""
        return 0 if self.held is None else sum(a.nbytes for a in self.held if a is not None)

    def _features(self) -> tuple:
        if self.held is None:
            if self.refill is None:
                raise RuntimeError("the prompt's image features were dropped and cannot be made again")
            self.held = self.refill()
            self.num_refills += 1
        return self.held

    def take(self, start: int, n: int) -> tuple[np.ndarray, mx.array | None, mx.array | None]:
        """For a pass feeding tokens `[start, start + n)`: (the offsets among them that hold image
        tokens, their features, their deepstack features or None). The pass that reaches the
        last image row (or starts past it: a prefix hit) drops the features."""
        last = self.last_row
        if start > last:
            self.held = None
            return self.rows[:0], None, None
        offs, src = self.rows_of(start, n)
        feats = deep = None
        if len(offs):
            features, deepstack = self._features()
            src = mx.array(src)
            feats = features[src]
            deep = deepstack[:, src] if deepstack is not None else None
        if start + n > last:
            self.held = None
        return offs, feats, deep

    def block_key(self, i: int, block_size: int) -> bytes:
        """The content hashes of the images with a token in block i (b"" when none): folded into
        the block's hash, so two different images never share a block (core/block_manager.py)."""
        lo, hi = i * block_size, (i + 1) * block_size
        return b"".join(d for s, e, d in self.spans if s < hi and e > lo)

    def rows_of(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(the offsets within `[start, start + n)` that hold image tokens, their feature rows)."""
        a, b = np.searchsorted(self.rows, [start, start + n])
        return self.rows[a:b] - start, np.arange(a, b)

    def positions_of(self, start: int, n: int) -> np.ndarray:
        """`[3, n]` positions of tokens `start..start+n` (prompt ones from `positions`, later ones
        at p + delta)."""
        p = np.arange(start, start + n)
        out = np.broadcast_to(p + self.delta, (3, n)).copy()
        if self.positions is not None:
            inside = p < self.positions.shape[1]
            out[:, inside] = self.positions[:, p[inside]]
        return out.astype(np.int32)


ENCODER_CACHE_BYTES = 256 << 20  # the vision tower's outputs kept across requests


class EncoderCache:
    """The vision tower's output per image, by content digest (`image_digest`), least recently
    used first out. Invariant: `nbytes` is the bytes of the outputs held and stays at most
    `max_bytes` (an output larger than that is not kept)."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def get(self, digest: bytes):
        got = self.entries.get(digest)
        if got is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(digest)
        return got[0]

    def put(self, digest: bytes, output) -> None:
        size = sum(a.nbytes for a in _arrays(output))
        if size > self.max_bytes or digest in self.entries:
            return
        while self.nbytes + size > self.max_bytes:
            _, (_, freed) = self.entries.popitem(last=False)
            self.nbytes -= freed
        self.entries[digest] = (output, size)
        self.nbytes += size


def _arrays(output) -> list:
    if isinstance(output, (tuple, list)):
        return [a for o in output for a in _arrays(o)]
    return [output]


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """A prompt's images after mlx-vlm's processor (numpy work, no model): `ids` the prompt's
    token ids with each image's one marker widened to its image tokens, `processed` the
    processor's pixel inputs of each image, `digests` each image's content hash, `spans` the `[start, end)` rows
    each image's marker was widened to (its image tokens, and any text tokens the processor puts
    around or between them), in prompt order; `images` the decoded images themselves (what a
    recompute processes again)."""

    ids: list[int]
    processed: list[dict]
    digests: list[bytes]
    spans: list[tuple[int, int]]
    images: tuple = ()

    @property
    def num_images(self) -> int:
        return len(self.digests)

    @property
    def pixel_bytes(self) -> int:
        """Bytes of the processor's inputs (pixel values, grids)."""
        return sum(getattr(a, "nbytes", 0) for p in self.processed for a in p.values())

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the decoded images (8-bit channels)."""
        return sum(im.width * im.height * len(im.getbands()) for im in self.images)


def _process_one(model, processor, image) -> tuple[list[int], dict]:
    """(the ids the processor widens one image's marker to, its pixel inputs): the image with its
    marker alone."""
    from mlx_vlm.utils import prepare_inputs

    one = dict(
        prepare_inputs(
            processor, images=[image], prompts=model.marker(processor), image_token_index=model.image_token_id
        )
    )
    one.pop("attention_mask", None)
    return np.asarray(one.pop("input_ids")[0]).tolist(), one


def process_images(loaded, ids: list[int], images: list) -> ImageInputs:
    """`ImageInputs` of a prompt's token ids (each image one marker token, as a chat template
    writes it) and its decoded images: mlx-vlm's processor on the images, each marker widened to
    as many image tokens as the processor makes of its image. A ValueError names what is wrong."""
    name = loaded.path.name
    model, processor = loaded.model, loaded.processor
    if processor is None or not getattr(model, "multimodal", False):
        raise ValueError(f"model {name} takes no images (it has no vision tower)")
    marker = processor.tokenizer.convert_tokens_to_ids(model.marker(processor))
    markers = [i for i, t in enumerate(ids) if t == marker]
    if len(markers) != len(images):
        raise ValueError(f"the prompt has {len(markers)} image markers for {len(images)} images")
    pieces, processed = zip(*(_process_one(model, processor, image) for image in images)) if images else ((), ())
    out, spans, last = [], [], 0
    for at, piece in zip(markers, pieces):
        out += ids[last:at]
        spans.append((len(out), len(out) + len(piece)))
        out += piece
        last = at + 1
    out += ids[last:]
    return ImageInputs(out, list(processed), [image_digest(im) for im in images], spans, tuple(images))


def encode_images(model, inputs: ImageInputs, cache: EncoderCache | None = None) -> PromptImages:
    """The `PromptImages` of processed images: the model's `get_input_embeddings`
    (models/vision.py), each image's output from `cache` when it holds it."""
    is_image = np.asarray(inputs.ids) == model.image_token_id
    rows = np.concatenate([s + np.flatnonzero(is_image[s:e]) for s, e in inputs.spans]).astype(np.int64)
    spans = tuple((s, e, d) for (s, e), d in zip(inputs.spans, inputs.digests))
    features, deepstack, positions, delta = model.prompt_features(inputs, rows, cache)
    mx.eval(features, *([deepstack] if deepstack is not None else []))
    pos = None if positions is None else np.asarray(positions, dtype=np.int32)
    return PromptImages(rows, (features, deepstack), spans, pos, delta)


def encode_prompt_images(loaded, inputs: ImageInputs, cache: EncoderCache | None = None) -> PromptImages:
    """`encode_images`, able to make its features again once they are dropped (`PromptImages.refill`):
    from the encoder cache, or the vision tower on what the request keeps of its images, the
    smaller of the processor's pixel inputs and the decoded images (processed again)."""
    out = encode_images(loaded.model, inputs, cache)
    if inputs.images and inputs.decoded_bytes < inputs.pixel_bytes:
        kept = replace(inputs, processed=[])
        out.refill = lambda: _encode_again(loaded, kept, cache)
    else:
        kept = replace(inputs, images=())
        out.refill = lambda: encode_images(loaded.model, kept, cache).held
    return out


def _encode_again(loaded, kept: ImageInputs, cache: EncoderCache | None) -> tuple:
    processed = [_process_one(loaded.model, loaded.processor, im)[1] for im in kept.images]
    return encode_images(loaded.model, replace(kept, processed=processed), cache).held


def load_image(source, where: str = "image"):
    """A decoded RGB image from a PIL image, a path, or the file's bytes; a ValueError naming
    `where` when it is none of those or does not decode."""
    import io

    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        try:
            if isinstance(source, (bytes, bytearray)):
                image = Image.open(io.BytesIO(source))
            elif isinstance(source, (str, Path)):
                image = Image.open(Path(source).expanduser())
            else:
                raise ValueError(f"{where}: expected an image, a path or bytes, got {type(source).__name__}")
            image.load()
        except FileNotFoundError:
            raise ValueError(f"{where}: no such file") from None
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{where}: not a decodable image ({str(e).splitlines()[0][:120]})") from None
    return image.convert("RGB")


def decode_images(images: list) -> list:
    """Each of `images` decoded (`load_image`); an error names the image by its place (and path)."""
    return [
        load_image(im, f"image {i}" + (f" ({im})" if isinstance(im, (str, Path)) else ""))
        for i, im in enumerate(images)
    ]
