import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    README = f.read()

setup(
    name="gluon-amp",
    version="0.1.0",
    description="Automatic mixed precision (float16/bfloat16) for MXNet Gluon",
    long_description=README,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gluon_amp", "gluon_amp.*", "gluon_amp_core", "gluon_amp_core.*"]),
    # the emulation kernel's source: compiled on the user's machine on first use
    package_data={"gluon_amp.emulation_kernel": ["*.cc"]},
    # 3.13: numpy<2, which MXNet 1.9.1 needs, has no wheels for it (docs/python.md).
    python_requires=">=3.11,<3.13",
    install_requires=[
        # numpy 1.24-1.26 work through gluon_amp/_numpy_shim.py; 3.12 has wheels from 1.26 on
        # only, and this keeps pip from building an older numpy from source there.
        "numpy>=1.23,<2; python_version<'3.12'",
        "numpy>=1.26,<2; python_version>='3.12'",
        # MXNet 1.9.1 and GluonCV 0.10 import distutils, which Python 3.12 removed
        "setuptools>=68; python_version>='3.12'",
    ],
    extras_require={
        "cpu": ["mxnet==1.9.1"],
        "cu112": ["mxnet-cu112==1.9.1"],
        # gluoncv 0.10.5.post0 pulls opencv/scipy; newer ones need numpy 2.
        "bench": ["gluoncv==0.10.5.post0", "opencv-python==4.11.0.86", "scipy==1.15.3",
                  "matplotlib<3.9", "psutil", "tqdm"],
        "notebook": ["nbclient>=0.7", "nbformat>=5.7", "ipykernel>=6"],
        "test": ["pytest>=7"],
        # Build horovod against the installed MXNet first (see README / `make install-dist`):
        # a plain pip build of it has no MXNet support.
        "dist": ["horovod==0.28.1", "psutil"],
    },
    entry_points={"console_scripts": ["gluon-amp-convert=gluon_amp.convert.cli:main"]},
)
