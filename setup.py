import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))

# Every interpreter start of the environment runs this line (site.py reads *.pth files in
# site-packages, as for setuptools' distutils-precedence.pth). It imports one small module,
# which waits for the first `import mxnet`/`import gluoncv` to restore the numpy aliases MXNet
# 1.9.1 needs (docs/python.md). GLUON_AMP_NUMPY_SHIM=0 skips even that import.
PTH_NAME = "gluon_amp-numpy-aliases.pth"
PTH_LINE = ("import os; os.environ.get('GLUON_AMP_NUMPY_SHIM', '1').strip() == '0' "
            "or __import__('_gluon_amp_startup').install()\n")


class build_py_with_pth(build_py):
    """build_py that also writes PTH_NAME at the root of what gets installed.

    A wheel: the root of build_lib (the wheel's root, i.e. site-packages). An editable
    install (PEP 660, setuptools >= 64): editable_wheel points ``install_lib`` at the root of
    the editable wheel it is building; build_lib is discarded there.
    """

    def run(self) -> None:
        super().run()
        root = self.build_lib
        if getattr(self, "editable_mode", False):
            root = self.get_finalized_command("install").install_lib
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [os.path.join(self.build_lib, PTH_NAME)]

with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    README = f.read()

setup(
    name="gluon-amp",
    version="0.1.0",
    description="Automatic mixed precision (float16/bfloat16) for MXNet Gluon",
    long_description=README,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gluon_amp", "gluon_amp.*", "gluon_amp_core", "gluon_amp_core.*"]),
    py_modules=["_gluon_amp_startup"],  # run at interpreter start by PTH_NAME
    cmdclass={"build_py": build_py_with_pth},
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
        # gluonnlp: the client tests run its models (pip builds its sdist, about 13 s).
        # wheel: a test builds gluon-amp's wheel, and setuptools before 70.1 has no bdist_wheel.
        # ruff: the linter `make lint` / `make test` run (ruff.toml).
        # hypothesis: the stateful property test (tests/mxnet_layer/state/test_stateful.py).
        # pytest-xdist: `make test` runs the suite in a process per core (Makefile, TEST_WORKERS).
        "test": ["pytest>=7", "pytest-xdist>=3.2", "gluonnlp==0.10.0", "wheel", "ruff>=0.2", "hypothesis>=6.100"],
        # Build horovod against the installed MXNet first (see README / `make install-dist`):
        # a plain pip build of it has no MXNet support.
        "dist": ["horovod==0.28.1", "psutil"],
    },
    entry_points={"console_scripts": ["gluon-amp-convert=gluon_amp.convert.cli:main"]},
)
