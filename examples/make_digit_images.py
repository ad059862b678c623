"""Write the package's 8x8 handwritten digits, upsampled, as an image folder for the image recipe.

    python examples/make_digit_images.py data/digit_images --size 32
    dtrain examples/configs/images_cpu.yaml

It writes data/digit_images/train/<digit>/<i>.png (80%) and data/digit_images/val/<digit>/<i>.png (20%).
"""

import argparse
import sys

from distributed_training.datasets.images import write_digits_folder

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", default="data/digit_images", help="folder to write (train/ and val/ in it)")
    p.add_argument("--size", type=int, default=32, help="side of the images in pixels")
    p.add_argument("--format", default="png", choices=["png", "jpg"], help="image file format")
    args = p.parse_args()
    try:
        counts = write_digits_folder(args.root, args.size, extension=args.format)
    except FileExistsError as err:  # an earlier run's images in another format: they would be read too
        sys.exit(f"error: {err}")
    print(f"wrote {counts['train']} training and {counts['val']} validation images under {args.root}")
