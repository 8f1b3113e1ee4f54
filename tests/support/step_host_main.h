/* The host driver for the CUDA C step fill (see cuda_host.h), included after the kernel
   (step_host.cpp). stdin: a case count, then per case three lines "n v[0] .. v[n-1]"
   (query_start_loc, num_computed_tokens, checkpoint_offsets; the last two may be empty) and a line
   "first_seq num_seqs batch_seqs rows0 .. rows5 arena_bytes", the kernel's scalar arguments as
   chunkmeta's step build passes them. The grid is the step build's: per entry max(1,
   cdiv(rows_j, BLOCK_ROWS)) programs. The arena starts zeroed, as the builder's does; inputs are
   allocated to their exact sizes (an out-of-bounds read is a sanitizer error).
   stdout per case: "A" then the arena's bytes in hex. */
struct Case {
  std::vector<QSL_T> q;
  std::vector<COMP_T> computed;
  std::vector<CKPT_T> checkpoints;
  int first_seq, num_seqs, batch_seqs, rows[6];
  std::vector<long long> arena; /* 8-byte aligned, as the builder's regions are 16-byte aligned */
  long long arena_bytes;
};

template <typename T>
static bool read_values(std::vector<T> &out) {
  long long n;
  if (scanf("%lld", &n) != 1) return false;
  out.resize(n);
  for (auto &v : out) {
    long long read;
    if (scanf("%lld", &read) != 1) return false;
    v = (T)read;
  }
  return true;
}

int main() {
  int count;
  if (scanf("%d", &count) != 1) return 2;
  std::vector<Case> cases(count);
  for (auto &c : cases) {
    if (!read_values(c.q) || !read_values(c.computed) || !read_values(c.checkpoints)) return 2;
    if (scanf("%d %d %d", &c.first_seq, &c.num_seqs, &c.batch_seqs) != 3) return 2;
    for (int &r : c.rows)
      if (scanf("%d", &r) != 1) return 2;
    if (scanf("%lld", &c.arena_bytes) != 1) return 2;
    c.arena.assign((c.arena_bytes + 7) / 8, 0);
    if (c.computed.empty()) c.computed.push_back(0); /* an address the kernel never reads */
    if (c.checkpoints.empty()) c.checkpoints.push_back(0);
  }
  run_blocks(
      cases, THREADS,
      [](const Case &c) {
        unsigned grid = 0;
        for (int j = 0; j < NUM_ENTRIES; j++) grid += (unsigned)max((c.rows[j] + BLOCK_ROWS - 1) / BLOCK_ROWS, 1);
        return grid;
      },
      [](Case &c) {
        step_tables_fill(c.q.data(), c.computed.data(), c.checkpoints.data(), (char *)c.arena.data(), nullptr,
                         c.first_seq, c.num_seqs, c.batch_seqs, c.rows[0], c.rows[1], c.rows[2], c.rows[3], c.rows[4],
                         c.rows[5]);
      });
  for (auto &c : cases) {
    printf("A ");
    const unsigned char *bytes = (const unsigned char *)c.arena.data();
    for (long long i = 0; i < c.arena_bytes; i++) printf("%02x", bytes[i]);
    printf("\n");
  }
  return 0;
}
