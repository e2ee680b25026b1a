from . import dlpack
