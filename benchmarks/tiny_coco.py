"""A tiny COCO-style instance-segmentation set, generated: for running real training scripts
(GluonCV's ``train_mask_rcnn.py``, ``train_center_net.py``) a few iterations without COCO.

``python benchmarks/tiny_coco.py ROOT [--images N] [--size H W] [--seed S]`` writes
``ROOT/annotations/instances_{train,val}2017.json`` and ``ROOT/{train,val}2017/*.jpg``: each
image holds 1-3 filled rectangles of random COCO categories on noise, each annotated with its
box, area and polygon. GluonCV reads it where it expects COCO (``~/.mxnet/datasets/coco``), so
point ``HOME`` at a folder holding ``.mxnet/datasets/coco`` = ROOT. The 80 category names are
the ones COCO uses (GluonCV checks them), with ids 1..80.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import List, Sequence

import numpy as np

#: COCO 2017's 80 category names, in id order (GluonCV compares them with its class list)
CATEGORIES = (
    "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant "
    "stop_sign parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe "
    "backpack umbrella handbag tie suitcase frisbee skis snowboard sports_ball kite baseball_bat "
    "baseball_glove skateboard surfboard tennis_racket bottle wine_glass cup fork knife spoon bowl "
    "banana apple sandwich orange broccoli carrot hot_dog pizza donut cake chair couch "
    "potted_plant bed dining_table toilet tv laptop mouse remote keyboard cell_phone microwave oven "
    "toaster sink refrigerator book clock vase scissors teddy_bear hair_drier toothbrush"
).split()
CATEGORIES = tuple(c.replace("_", " ") for c in CATEGORIES)


def make_split(root: str, split: str, n: int, size: Sequence[int], rng: np.random.RandomState) -> None:
    """Write ``n`` images of ``size`` (height, width) and their annotations for ``split``."""
    from PIL import Image  # only here: the generator's one dependency beyond NumPy

    h, w = size
    folder = os.path.join(root, f"{split}2017")
    os.makedirs(folder, exist_ok=True)
    images: List[dict] = []
    annotations: List[dict] = []
    for i in range(n):
        pixels = rng.randint(0, 60, size=(h, w, 3)).astype(np.uint8)
        image_id = i + 1
        for _ in range(rng.randint(1, 4)):
            bw, bh = rng.randint(w // 6, w // 2), rng.randint(h // 6, h // 2)
            x0, y0 = rng.randint(0, w - bw), rng.randint(0, h - bh)
            pixels[y0:y0 + bh, x0:x0 + bw] = rng.randint(100, 255, size=3)
            category = int(rng.randint(0, 3)) + 1  # a few classes, so each is seen
            polygon = [x0, y0, x0 + bw, y0, x0 + bw, y0 + bh, x0, y0 + bh]
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category,
                                "bbox": [x0, y0, bw, bh], "area": float(bw * bh), "iscrowd": 0,
                                "segmentation": [[float(v) for v in polygon]]})
        name = f"{image_id:012d}.jpg"
        Image.fromarray(pixels).save(os.path.join(folder, name), quality=95)
        images.append({"id": image_id, "file_name": name, "height": h, "width": w,
                       "coco_url": f"{split}2017/{name}"})  # GluonCV reads the folder from it
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    categories = [{"id": k + 1, "name": c, "supercategory": "thing"} for k, c in enumerate(CATEGORIES)]
    with open(os.path.join(root, "annotations", f"instances_{split}2017.json"), "w") as f:
        json.dump({"images": images, "annotations": annotations, "categories": categories}, f)


def main(argv: Sequence[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--size", type=int, nargs=2, default=(128, 160), metavar=("H", "W"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = np.random.RandomState(a.seed)
    make_split(a.root, "train", a.images, a.size, rng)
    make_split(a.root, "val", max(2, a.images // 4), a.size, rng)
    print(f"tiny COCO set: {a.images} train images in {a.root}")


if __name__ == "__main__":
    main()
