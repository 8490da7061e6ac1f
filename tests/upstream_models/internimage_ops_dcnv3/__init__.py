# OURS, not upstream: no classification/ops_dcnv3/__init__.py of InternImage was in the stored copy of the
# repository these tests were written from. This one only makes upstream_models.internimage_ops_dcnv3 a regular
# package (functions/ and modules/ below it), so that the copied files' relative imports resolve.
