# OURS: the package around the unchanged copies of the DCNv4 repository's DCNv4_op/DCNv4/modules/ (in modules/)
# and our functions/ (upstream's DCNv4 package __init__ is not copied: it imports the compiled extension).
