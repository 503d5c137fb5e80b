// What a matvec kernel does before matvec() (matvec.cuh includes it, inside each kernel file's
// anonymous namespace; not a standalone header): the layer's address and format read on the
// device, a launch's dense rows, and the prologue that holds the block's activation rows in
// shared memory (and where the bulk-copy stages follow them).
#ifndef JAXVT_FFI_CSRC_MATVEC_SETUP_CUH_
#define JAXVT_FFI_CSRC_MATVEC_SETUP_CUH_

__device__ __forceinline__ LayerRef layer_ref(const WeightArgs& w) {
  return resolve_layer(w.data, w.stride, w.table, w.fmts, w.n_layers, *w.layer);
}

// Dense rows b0 .. b0 + nb - 1 (nb <= BT) of x [*, cols] and y [*, rows].
template <int BT>
__device__ __forceinline__ Rows<BT> dense_rows(const float* x, int64_t b0, int nb, float* y,
                                               int64_t rows, int64_t cols) {
  Rows<BT> R;
  R.slot = nullptr;
  R.x = x;
  R.y = y;
  R.cols = cols;
  R.rows = rows;
  R.b0 = b0;
  R.nb = nb;
  R.k = 1;
  R.x_per_slot = 0;
  R.dense = 1;
  R.xs = nullptr;
  R.xs_stride = xs_stride(cols);
  R.xq = nullptr;
  R.xq_stride = xq_bytes(cols);
  R.xq_upad = xq_upad(cols);
  return R;
}

// The block's activations as XM says: held float32 rows, quantized rows for a quantized format
// under ggml's arithmetic, or nothing (read from global memory); `after` is the dynamic shared
// memory past the warps' slots. As matvec's prologue (all threads of the block; ends with a
// barrier when it holds anything). For XM 1 the first loads (xl, hold_x_load) are issued by the
// kernel before it reads the layer's address.
template <int BT, int XM>
struct HoldRows {
  int fmt;
  XLoad xl;
  uint4* after;
  __device__ __forceinline__ void operator()(Rows<BT>& R) const {
    const bool quantized = fmt != kF32 && fmt != kF16 && fmt != kBF16;
    if (XM == 1 || (XM == 2 && !quantized)) {
      float4* xs = reinterpret_cast<float4*>(after);
      hold_x_store<BT>(xs, XM == 1 ? xl : hold_x_load<BT>(R, R.nb), R, R.nb);
      R.xs = xs;
    } else if (XM == 2) {
      uint8_t* xq = reinterpret_cast<uint8_t*>(after);
      hold_xq<BT>(xq, R, R.nb, act_type(fmt));
      R.xq = xq;
    }
  }
};

// Reads the layer's address and format, and makes matvec's prologue for it.
template <int BT, int XM>
__device__ __forceinline__ HoldRows<BT, XM> resolve_and_hold(const WeightArgs& w, const Rows<BT>& R,
                                                             uint4* after_slots, LayerRef* L) {
  HoldRows<BT, XM> h;
  if (XM == 1) h.xl = hold_x_load<BT>(R, R.nb);
  *L = layer_ref(w);
  h.fmt = L->fmt;
  h.after = after_slots;
  return h;
}

// Whether matvec() takes matvec_bulk for the matrix the block reads: bulk, the launch's stage
// bytes (0: none allocated), and not over the bus (`over_bus`: the matrix is in the host tier),
// where the per-warp windows read faster. The stages follow the block's held activation rows
// under ggml's arithmetic (`held`: where those rows start).
template <int BT, int XM>
__device__ __forceinline__ void use_bulk(Rows<BT>& R, int64_t bulk, uint4* held, bool over_bus) {
  if (XM == 2 && bulk > 0 && !over_bus) {
    R.bulk = bulk;
    R.bulk_smem = reinterpret_cast<uint8_t*>(held) + BT * ggml_held_row_bytes(R.cols);
  }
}

__device__ __forceinline__ int clamp_id(int32_t v, int64_t n) {
  return v < 0 ? 0 : (v >= n ? static_cast<int>(n - 1) : v);
}

#endif  // JAXVT_FFI_CSRC_MATVEC_SETUP_CUH_
