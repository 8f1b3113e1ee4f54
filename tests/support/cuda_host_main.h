/* The host driver for the CUDA C fill (see cuda_host.h), included after the kernel (cuda_host.cpp).
   stdin: a case count, then per case a line "n q[0] .. q[n-1]" (query_start_loc) and a line
   "first_seq num_seqs num_rows seqs_out pad_seq", the kernel's scalar arguments as
   chunkmeta.native passes them. The grid is chunkmeta.native's: cdiv(num_rows, BLOCK_ROWS), at
   least 1. Outputs are allocated to their exact sizes, so an out-of-bounds access is a
   sanitizer error, and filled with a poison value first, so a missed entry shows.
   stdout per case: "CU ..." (cu_seqlens), "CO ..." (chunk_offsets), "CI i t i t ..." (rows). */
struct Case {
  std::vector<QSL_T> q;
  int first_seq, num_seqs, num_rows, seqs_out, pad_seq;
  std::vector<int> cu;
  std::vector<OFFSET_T> offsets;
  std::vector<long long> rows;
};

int main() {
  int count;
  if (scanf("%d", &count) != 1) return 2;
  std::vector<Case> cases(count);
  for (auto &c : cases) {
    long long n;
    if (scanf("%lld", &n) != 1) return 2;
    c.q.resize(n);
    for (auto &v : c.q) {
      long long read;
      if (scanf("%lld", &read) != 1) return 2;
      v = (QSL_T)read;
    }
    if (scanf("%d %d %d %d %d", &c.first_seq, &c.num_seqs, &c.num_rows, &c.seqs_out, &c.pad_seq) != 5) return 2;
    c.cu.assign(c.seqs_out + 1, 0x55555555);
    c.offsets.assign(c.seqs_out + 1, (OFFSET_T)0x5555555555555555LL);
    c.rows.assign(c.num_rows, 0x5555555555555555LL);
    c.cu[0] = 0; /* the builder's buffers hold 0 there: the kernel never writes entry 0 */
    c.offsets[0] = 0;
  }
  run_blocks(
      cases, THREADS,
      [](const Case &c) { return c.num_rows > 0 ? (unsigned)(c.num_rows + BLOCK_ROWS - 1) / BLOCK_ROWS : 1u; },
      [](Case &c) {
        chunk_metadata_fill(c.q.data(), nullptr, c.cu.data(), c.rows.data(), c.offsets.data(), c.first_seq,
                            c.num_seqs, c.num_rows, c.seqs_out, c.pad_seq);
      });
  for (auto &c : cases) {
    printf("CU");
    for (int v : c.cu) printf(" %d", v);
    printf("\nCO");
    for (OFFSET_T v : c.offsets) printf(" %lld", (long long)v);
    printf("\nCI");
    for (long long v : c.rows) printf(" %d %d", (int)(v & 0xffffffff), (int)(v >> 32));
    printf("\n");
  }
  return 0;
}
