# OURS, not an upstream copy: InternImage's classification/ops_dcnv3/modules/__init__.py was not in the stored
# copy of the repository these tests were written from. It exports what the upstream one does (what
# models/intern_image.py reads as opsm.DCNv3 and opsm.DCNv3_pytorch), from the unchanged dcnv3.py beside it.
from .dcnv3 import DCNv3, DCNv3_pytorch
