"""Boxes on the attention grid: exact coverage of each cell by the union of a category's boxes, and
COCO instance annotations (pycocotools)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

def _snap(v: np.ndarray) -> np.ndarray:
    """Grid coordinates within 1e-9 of an integer become that integer, so a box drawn exactly on a
    cell edge in pixels stays exactly on it after scaling (no sliver of coverage from rounding)."""
    r = np.round(v)
    return np.where(np.abs(v - r) < 1e-9, r, v)


def box_coverage(boxes: np.ndarray, width: float, height: float, grid_h: int, grid_w: int) -> np.ndarray:
    """boxes (N, 4) as COCO [x, y, w, h] in pixels of a width x height photo -> (grid_h, grid_w) fraction
    of each cell's area inside the union of the boxes (exact; overlaps are counted once)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    sx, sy = grid_w / float(width), grid_h / float(height)
    x0 = _snap(np.clip(boxes[:, 0] * sx, 0, grid_w))  # (N,) in cell units
    x1 = _snap(np.clip((boxes[:, 0] + boxes[:, 2]) * sx, 0, grid_w))
    y0 = _snap(np.clip(boxes[:, 1] * sy, 0, grid_h))
    y1 = _snap(np.clip((boxes[:, 1] + boxes[:, 3]) * sy, 0, grid_h))
    xs = np.unique(np.concatenate([x0, x1, np.arange(grid_w + 1)]))  # (X,) every box and cell edge
    ys = np.unique(np.concatenate([y0, y1, np.arange(grid_h + 1)]))  # (Y,)
    mx, my = (xs[1:] + xs[:-1]) / 2, (ys[1:] + ys[:-1]) / 2  # (X-1,), (Y-1,) centres of the pieces
    inside_x = (x0[:, None] < mx) & (mx < x1[:, None])  # (N, X-1)
    inside_y = (y0[:, None] < my) & (my < y1[:, None])  # (N, Y-1)
    covered = (inside_y[:, :, None] & inside_x[:, None, :]).any(axis=0)  # (Y-1, X-1): in the union
    area = np.diff(ys)[:, None] * np.diff(xs)[None, :] * covered  # (Y-1, X-1)
    cell_y = np.minimum(my.astype(int), grid_h - 1)  # each piece lies inside exactly one cell
    cell_x = np.minimum(mx.astype(int), grid_w - 1)
    cov = np.zeros((grid_h, grid_w))
    np.add.at(cov, (cell_y[:, None], cell_x[None, :]), area)
    return np.clip(cov, 0.0, 1.0)  # a cell has area 1 in cell units


@dataclass
class Instances:
    path: Path
    categories: list[str]  # names, in the file's order
    boxes: dict[str, dict[str, np.ndarray]]  # image id (text) -> category -> (N, 4) [x, y, w, h] pixels
    sizes: dict[str, tuple[int, int]]  # image id -> (width, height) of the stored photo

    def coverage(self, image_id: str, grid_h: int, grid_w: int) -> dict[str, np.ndarray]:
        """category -> (grid_h, grid_w) coverage, for the categories with boxes of non-zero area."""
        w, h = self.sizes[image_id]
        out = {}
        for cat, b in self.boxes.get(image_id, {}).items():
            cov = box_coverage(b, w, h, grid_h, grid_w)
            if cov.sum() > 0:
                out[cat] = cov
        return out


def instances_path_for(captions_json: str | Path) -> Path:
    """captions_X.json -> instances_X.json in the same folder (whether or not it exists)."""
    p = Path(captions_json)
    name = p.name.replace("captions_", "instances_", 1) if p.name.startswith("captions_") else "instances_" + p.name
    return p.with_name(name)


def load_instances(path: str | Path) -> Instances:
    """A COCO instances_*.json (through pycocotools) -> boxes per image and category."""
    from ..data.coco import open_coco

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"COCO instance annotations not found: {path}. Download annotations_trainval2017.zip "
                                "from cocodataset.org (it holds instances_*.json beside captions_*.json) or pass "
                                "--instances PATH.")
    coco = open_coco(path, "a COCO instances_*.json")
    if not coco.dataset.get("categories"):
        raise ValueError(f"{path} has no 'categories': is it an instances_*.json (not captions_*.json)?")
    names = {c["id"]: c["name"] for c in coco.loadCats(coco.getCatIds())}
    grouped: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for a in coco.loadAnns(coco.getAnnIds(iscrowd=None)):
        grouped[str(a["image_id"])][names[a["category_id"]]].append(a["bbox"])
    boxes = {img: {c: np.asarray(b, dtype=np.float64).reshape(-1, 4) for c, b in cats.items()}
             for img, cats in grouped.items()}
    sizes = {str(i["id"]): (int(i["width"]), int(i["height"])) for i in coco.loadImgs(coco.getImgIds())}
    return Instances(path, [names[k] for k in sorted(names)], boxes, sizes)
