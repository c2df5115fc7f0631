"""Install exl (metadata in pyproject.toml).

By default the C++/CUDA kernels are compiled on first use (cached; see cuda_ext/build.py). Set
EXL_BUILD_EXT=1 to build them now as prebuilt extensions (needs torch in the build environment):
    EXL_BUILD_EXT=1 pip install --no-build-isolation .
The C++ standard follows the installed torch, and each library is stamped with its build key: a
prebuilt library is used only under the torch, Python and compiler it was built with.
"""

import os

from setuptools import setup

if os.environ.get("EXL_BUILD_EXT") == "1":
    from cuda_ext.build import setup_extensions, stamped_build_ext

    setup(ext_modules=setup_extensions(), cmdclass={"build_ext": stamped_build_ext()})
else:
    setup()
