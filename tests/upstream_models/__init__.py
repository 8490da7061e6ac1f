"""Unchanged copies of the upstream Python that deform_conv's DCNv3/DCNv4/FlashDeformAttn modules and its
``install_dcnv3``/``install_dcnv4`` shims stand in for, and the tests that run them side by side:

- internimage_ops_dcnv3/: InternImage's classification/ops_dcnv3 (functions/dcnv3_func.py, modules/dcnv3.py);
- internimage_models/intern_image.py: InternImage's classification model, loaded by path (conftest.py);
- dcnv4_modules/modules/: the DCNv4 repository's DCNv4_op/DCNv4/modules.

Each copied file starts with a comment block naming its repository, path and commit; below it the file is upstream's,
byte for byte. The ``__init__.py`` files and dcnv4_modules/functions/ are ours (each says so). Upstream code needs
the shims in sys.modules when it is imported (``import DCNv3``, ``from DCNv4 import ...``): conftest.py imports it
with them installed and puts sys.modules back afterwards."""
