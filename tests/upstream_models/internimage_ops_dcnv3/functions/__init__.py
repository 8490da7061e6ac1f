# OURS, not an upstream copy: InternImage's classification/ops_dcnv3/functions/__init__.py was not in the stored
# copy of the repository these tests were written from. It exports what the upstream one does (what
# modules/dcnv3.py imports with `from ..functions import DCNv3Function, dcnv3_core_pytorch`), from the unchanged
# dcnv3_func.py beside it. Importing it runs `import DCNv3`: install deform_conv's shim first (conftest.py does).
from .dcnv3_func import DCNv3Function, dcnv3_core_pytorch
