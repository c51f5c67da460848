// The CPU backend of kernels/sparse_ops.h. Only the factory is public:
// CreateCpuSparseOps() in sparse_ops.h.
#pragma once

#include "kernels/sparse_ops.h"
