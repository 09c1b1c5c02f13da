// The drafter's small device `meta` block (int32): the row offsets and positions that the drafter's kernels
// (drafter.cu) and the DDTree round's kernels (ddtree.cu) read, so a round's launches can be captured once
// as a CUDA graph and replayed after the host (or the device walk) rewrites meta:
//   meta[0] ctx_row   first drafter-cache row of the context rows being ingested (S)
//   meta[1] ctx_pos   its position (pos0 + S)
//   meta[2] n_ctx     cache rows the block attends to (start = S + C)
//   meta[3] blk_pos   position of block row 0 (pos0 + start)
//   meta[4] keep_n    rows the target's compaction keeps (0: none), meta[5] keep_start its first row,
//                     the kept rows being the context rows (the accepted path)
//   meta[6] n_new     context rows to ingest (C); a launch over more rows (a fixed-shape graph) writes C
#pragma once

#define DMETA_CTX_ROW 0
#define DMETA_CTX_POS 1
#define DMETA_N_CTX 2
#define DMETA_BLK_POS 3
#define DMETA_KEEP_N 4
#define DMETA_KEEP_START 5
#define DMETA_N_NEW 6
