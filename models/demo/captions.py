"""The demo pipeline's world: one shape of one colour on a background of another colour, and the
captions that describe it. Grammar (every caption the model was trained on):

    a <colour> <shape> at the <position> on a <colour> background
    a <colour> <shape> in the center on a <colour> background
    ("an" before orange)

colours: red, green, blue, yellow, white, black, purple, orange (shape and background differ);
shapes: circle, square, triangle; positions: top left, top, top right, left, right, bottom left,
bottom, bottom right (and center).

`render_batch` draws training images with torch; `check_image` scores a generated image (the
background's colour, the shape's colour, and which of the nine positions the shape's centre is
nearest), with only numpy, so that train_shapes.py's evaluation and tests/e2e/demo_e2e_test.py
apply one rule.
"""

import itertools

COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 70, 220), "yellow": (240, 220, 30),
    "white": (245, 245, 245), "black": (15, 15, 15), "purple": (140, 50, 200), "orange": (250, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {  # name -> (x, y) of the shape's centre, as fractions of the width and height.
    "top left": (0.25, 0.25), "top": (0.5, 0.25), "top right": (0.75, 0.25),
    "left": (0.25, 0.5), "center": (0.5, 0.5), "right": (0.75, 0.5),
    "bottom left": (0.25, 0.75), "bottom": (0.5, 0.75), "bottom right": (0.75, 0.75),
}
COLOUR_NAMES = list(COLOURS)
POSITION_NAMES = list(POSITIONS)


def caption(a):
    where = "in the center" if a["position"] == "center" else f"at the {a['position']}"
    return f"{article(a['fg'])} {a['fg']} {a['shape']} {where} on {article(a['bg'])} {a['bg']} background"


def article(word):
    return "an" if word[0] in "aeiou" else "a"


def all_captions():
    return [caption(dict(fg=fg, bg=bg, shape=s, position=p))
            for fg, bg, s, p in itertools.product(COLOUR_NAMES, COLOUR_NAMES, SHAPES, POSITION_NAMES) if fg != bg]


def render_batch(batch, size, gen, device):
    """Images in [-1, 1], [batch, 3, size, size], drawn at twice the size and averaged (soft edges)."""
    import torch

    def pick(n):
        return torch.randint(0, n, (batch,), generator=gen, device=device)

    fg = pick(len(COLOURS))
    bg = (fg + 1 + pick(len(COLOURS) - 1)) % len(COLOURS)
    shape = pick(len(SHAPES))
    pos = pick(len(POSITIONS))
    anchors = torch.tensor(list(POSITIONS.values()), device=device)
    jitter = (torch.rand(batch, 2, generator=gen, device=device) - 0.5) * 0.08
    centre = anchors[pos] + jitter
    r = 0.12 + 0.05 * torch.rand(batch, generator=gen, device=device)
    n = 2 * size
    coords = (torch.arange(n, device=device) + 0.5) / n
    y = coords.view(1, n, 1)
    x = coords.view(1, 1, n)
    cx, cy, rr = centre[:, 0].view(-1, 1, 1), centre[:, 1].view(-1, 1, 1), r.view(-1, 1, 1)
    circle = (x - cx) ** 2 + (y - cy) ** 2 <= rr ** 2
    square = ((x - cx).abs() <= 0.85 * rr) & ((y - cy).abs() <= 0.85 * rr)
    top, base = cy - rr, cy + 0.8 * rr
    frac = (y - top) / (base - top)
    triangle = (y >= top) & (y <= base) & ((x - cx).abs() <= frac * 1.1 * rr)
    masks = torch.stack([circle, square, triangle], 1).float()  # [B, 3, n, n]
    mask = masks[torch.arange(batch, device=device), shape].unsqueeze(1)
    mask = torch.nn.functional.avg_pool2d(mask, 2)
    palette = torch.tensor(list(COLOURS.values()), device=device, dtype=torch.float32) / 127.5 - 1
    image = palette[bg].view(-1, 3, 1, 1) * (1 - mask) + palette[fg].view(-1, 3, 1, 1) * mask
    attrs = [dict(fg=COLOUR_NAMES[f], bg=COLOUR_NAMES[b], shape=SHAPES[s], position=POSITION_NAMES[p])
             for f, b, s, p in zip(fg.tolist(), bg.tolist(), shape.tolist(), pos.tolist())]
    return image, attrs


def check_image(pixels, attrs, max_distance=80.0, min_fraction=0.01):
    """Scores uint8 pixels [H, W, 3] against the caption's attributes: each pixel takes the nearest
    palette colour (none when farther than max_distance); the background is the most common colour,
    the shape's colour the next most common (at least min_fraction of the pixels), and its position
    the anchor nearest to those pixels' centre. Returns the verdicts and what was found."""
    import numpy as np

    palette = np.array(list(COLOURS.values()), dtype=np.float32)
    flat = pixels.reshape(-1, 3).astype(np.float32)
    dist = np.linalg.norm(flat[:, None, :] - palette[None, :, :], axis=2)
    label = np.where(dist.min(1) <= max_distance, dist.argmin(1), -1)
    counts = np.bincount(label[label >= 0], minlength=len(palette))
    order = np.argsort(-counts, kind="stable")
    bg = int(order[0])
    fg = int(order[1]) if counts[order[1]] >= min_fraction * label.size else -1
    found = {"bg": COLOUR_NAMES[bg], "fg": COLOUR_NAMES[fg] if fg >= 0 else None, "position": None}
    if fg >= 0:
        h, w = pixels.shape[:2]
        ys, xs = np.nonzero(label.reshape(h, w) == fg)
        cx, cy = (xs.mean() + 0.5) / w, (ys.mean() + 0.5) / h
        anchors = np.array(list(POSITIONS.values()))
        found["position"] = POSITION_NAMES[int(np.argmin(((anchors - [cx, cy]) ** 2).sum(1)))]
    return {"fg": found["fg"] == attrs["fg"], "bg": found["bg"] == attrs["bg"],
            "position": found["position"] == attrs["position"], "found": found}


def eval_prompts(n=48):
    """A fixed, varied prompt set with seeds: colour pairs, shapes and positions cycled."""
    out = []
    for k in range(n):
        fg = COLOUR_NAMES[k % 8]
        bg = COLOUR_NAMES[(k * 3 + 1 + (k // 8)) % 8]
        if bg == fg:
            bg = COLOUR_NAMES[(COLOUR_NAMES.index(fg) + 4) % 8]
        out.append((dict(fg=fg, bg=bg, shape=SHAPES[k % 3], position=POSITION_NAMES[(k * 5) % 9]), 1000 + k))
    return out
