"""Install exl (metadata in pyproject.toml).

By default the C++/CUDA kernels are compiled on first use (cached; see cuda_ext/build.py). Set
EXL_BUILD_EXT=1 to build them now as prebuilt extensions (needs torch in the build environment):
    EXL_BUILD_EXT=1 pip install --no-build-isolation .
"""

import os

from setuptools import setup

if os.environ.get("EXL_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension

    from cuda_ext.build import setup_extensions

    setup(ext_modules=setup_extensions(), cmdclass={"build_ext": BuildExtension})
else:
    setup()
