// The layer loop of specdec's lean Llama path (BatchLlama.forward_fused for rows without token trees), in C++,
// and the small kernels both loops share (step_ops.h: RMSNorm, rotary positions, attention of one query).
//
// It computes what the Python loop in src/specdec/llama.py computes (`_attention`, `_mlp`, `_norm`,
// `exact_attention`, `Int4Weight.mm`), on the same shapes and in the same order: the same ATen operations where
// it calls ATen, the same functions of this file where the Python loop calls them (specdec.layerloop), and
// element for element the same arithmetic where it fuses ATen operations (the rotary positions); so its results
// are bit for bit the Python loop's (tests/models/test_layerloop.py). What it removes is the interpreter's work around
// each operation (~50 Python calls a layer) and a dozen small operations a layer. The products run on the kernel
// each weight was loaded for: PyTorch's int4 kernel (bfloat16 activations), specdec.qgemm's block kernels, or a
// float matrix. Where every query attends alone (one-token steps, verification passes) and every product is one
// of specdec.qgemm's block kernels, the layers run on one workspace of raw buffers (`run_raw`): the same
// operations on the same values, two ATen calls a layer (SiLU and its product) instead of ~35.
#include <torch/extension.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "step_ops.h"
#include "step_product.h"

namespace {

struct Layer {
  torch::Tensor in_norm, post_norm;
  Product qkv, o, gate_up, down;
  // what some families add (`specdec.families`; undefined where a layer has none): a bias on q|k|v, RMSNorms of each
  // head of q and of k, of the attention's and the MLP's outputs; the sliding window (0: none); the rotary table
  torch::Tensor qkv_bias, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t window = 0, rope = 0;
};

// The model's layers and shapes, built once per model (`specdec.step.stack_for`).
class Stack {
 public:
  Stack(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, int64_t chunk, int64_t fine, bool exact_rows)
      : n_heads_(n_heads),
        n_kv_(n_kv),
        head_dim_(head_dim),
        eps_(eps),
        chunk_(chunk),
        fine_(fine),
        exact_rows_(exact_rows) {
    TORCH_CHECK(head_dim > 0 && head_dim <= 256, "the layer loop: head sizes up to 256");
  }

  // A family's computation beside Llama's (`specdec.families.Arch`): GeGLU (gelu, tanh) instead of SwiGLU, and the
  // attention's scale where it is not 1/sqrt(head size) (0: that).
  void set_family(bool gelu, double scale) { gelu_ = gelu, scale_ = static_cast<float>(scale); }

  // The last added layer's extras (see Layer); each optional (None: the layer has none).
  void set_extras(const std::optional<torch::Tensor>& qkv_bias, const std::optional<torch::Tensor>& q_norm,
                  const std::optional<torch::Tensor>& k_norm, const std::optional<torch::Tensor>& attn_out_norm,
                  const std::optional<torch::Tensor>& mlp_out_norm, int64_t window, int64_t rope) {
    TORCH_CHECK(!layers_.empty(), "set_extras: add the layer first");
    Layer& w = layers_.back();
    const auto take = [&](const std::optional<torch::Tensor>& t, int64_t size, const char* what) {
      if (!t) return torch::Tensor();
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == size && t->is_contiguous(),
                  "set_extras: ", what, " must be float32 (", size, ",), dense");
      return *t;
    };
    w.qkv_bias = take(qkv_bias, w.qkv.out_rows, "qkv_bias");
    w.q_norm = take(q_norm, head_dim_, "q_norm");
    w.k_norm = take(k_norm, head_dim_, "k_norm");
    w.attn_out_norm = take(attn_out_norm, w.o.out_rows, "attn_out_norm");
    w.mlp_out_norm = take(mlp_out_norm, w.down.out_rows, "mlp_out_norm");
    TORCH_CHECK(w.q_norm.defined() == w.k_norm.defined(), "set_extras: q_norm and k_norm together");
    TORCH_CHECK(window >= 0 && rope >= 0, "set_extras: window and rope index >= 0");
    w.window = window, w.rope = rope;
  }

  void add_layer(const torch::Tensor& in_norm, const torch::Tensor& post_norm, const std::vector<Product>& products) {
    TORCH_CHECK(products.size() == 4, "a layer has four products (qkv, o, gate_up, down)");
    layers_.push_back(Layer{in_norm, post_norm, products[0], products[1], products[2], products[3]});
    // run_raw: every product into a buffer, dense norms, and every layer of the first one's shapes
    const Layer& first = layers_.front();
    for (const auto& p : products) raw_ = raw_ && p.has_into();
    raw_ = raw_ && in_norm.is_contiguous() && post_norm.is_contiguous() &&
           products[0].out_rows == (n_heads_ + 2 * n_kv_) * head_dim_ && products[1].in_features == n_heads_ * head_dim_ &&
           products[2].out_rows == 2 * products[3].in_features && products[1].out_rows == products[3].out_rows &&
           products[1].out_rows == first.o.out_rows && products[3].in_features == first.down.in_features;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  bool raw() const { return raw_; }

  // x (B, n, D) float32 after the embedding; cos and sin_signed (B, 1, n, hd) at each row's positions; per row its
  // slot's keys and values (L, Hkv, T, hd), start, new tokens and scored tokens. Runs the first n_layers layers,
  // writing each row's new keys and values into its slot, and returns the residual stream after them, with the
  // residual stream after each layer in `capture` (in order).
  std::pair<torch::Tensor, std::vector<torch::Tensor>> run(torch::Tensor x, const torch::Tensor& cos,
                                                           const torch::Tensor& sin_signed,
                                                           const std::vector<torch::Tensor>& keys,
                                                           const std::vector<torch::Tensor>& values,
                                                           const std::vector<int64_t>& starts,
                                                           const std::vector<int64_t>& n_new,
                                                           const std::vector<int64_t>& scored, int64_t n_layers,
                                                           const std::vector<int64_t>& capture,
                                                           const std::vector<std::vector<int64_t>>& trees,
                                                           const std::vector<torch::Tensor>& more_cos,
                                                           const std::vector<torch::Tensor>& more_sin) const {
    const auto rows = static_cast<int64_t>(keys.size());
    TORCH_CHECK(more_cos.size() == more_sin.size(), "one sin_signed per cos");
    std::vector<torch::Tensor> coss{cos}, sins{sin_signed};  // the rotary tables at each row's positions, by index
    coss.insert(coss.end(), more_cos.begin(), more_cos.end());
    sins.insert(sins.end(), more_sin.begin(), more_sin.end());
    for (const auto& w : layers_) TORCH_CHECK(w.rope < static_cast<int64_t>(coss.size()), "run: a layer's rotary table is missing");
    TORCH_CHECK(static_cast<int64_t>(values.size()) == rows && static_cast<int64_t>(starts.size()) == rows &&
                    static_cast<int64_t>(n_new.size()) == rows && static_cast<int64_t>(scored.size()) == rows,
                "one key buffer, value buffer, start, count of new and of scored tokens per row");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == rows, "x must be (rows, n, D)");
    const Trees tails = tree_tails(trees, starts, n_new, scored);
    TORCH_CHECK(tails.empty() || all_alone(n_new, scored), "token trees in the C++ loop: every query attends alone");
    for (const auto& w : layers_) TORCH_CHECK(tails.empty() || w.window == 0, "token trees in the C++ loop: no window");
    bool dense = true;
    for (size_t r = 0; r < coss.size(); ++r) dense = dense && coss[r].stride(3) == 1 && sins[r].stride(3) == 1;
    const int64_t count = n_layers < 0 ? size() : std::min(n_layers, size());
    std::vector<torch::Tensor> kept;
    c10::InferenceMode guard;
    if (raw_ && all_alone(n_new, scored) && x.is_contiguous() && x.scalar_type() == at::kFloat && dense)
      return {run_raw(x, coss, sins, keys, values, starts, n_new, tails, count, capture, kept), kept};
    // x is this call's own (the embedding's gather): added to in place until a layer's output is kept
    bool shared = false;
    for (int64_t i = 0; i < count; ++i) {
      const Layer& w = layers_[i];
      auto a = attention(i, norm(x, w.in_norm), coss[w.rope], sins[w.rope], keys, values, starts, n_new, scored, tails);
      x = shared ? x + a : x.add_(a);
      auto m = mlp(x, w);
      x = shared ? x + m : x.add_(m);
      for (int64_t c : capture)
        if (c == i) kept.push_back(x), shared = true;
    }
    return {x, kept};
  }

  // Per row, per new token, the slot rows a token tree's node attends to after the row's chain: its ancestors (root
  // first) and itself; empty for the chain's tokens and rows without a tree. The Python loop's `tree_layout`.
  using Trees = std::vector<std::vector<std::vector<int64_t>>>;

 private:
  inline static const std::vector<std::vector<int64_t>> kNoTails{};

  // trees: per row, the parents of its token tree (its last len(parents) new tokens; -1 the root), or empty. A tree
  // row's queries must all attend alone (its chain one token, every token scored), as in a verification pass.
  Trees tree_tails(const std::vector<std::vector<int64_t>>& trees, const std::vector<int64_t>& starts,
                   const std::vector<int64_t>& n_new, const std::vector<int64_t>& scored) const {
    Trees tails;
    bool any = false;
    for (const auto& t : trees) any = any || !t.empty();
    if (!any) return tails;
    TORCH_CHECK(trees.size() == starts.size(), "one tree (or none) per row");
    tails.resize(trees.size());
    for (size_t b = 0; b < trees.size(); ++b) {
      const auto& parents = trees[b];
      if (parents.empty()) continue;
      const auto nodes = static_cast<int64_t>(parents.size()), chain = n_new[b] - nodes;
      TORCH_CHECK(exact_rows_ && chain == 1 && scored[b] >= n_new[b],
                  "a token tree in the C++ loop: a chain of one token, every query scored alone");
      auto& rt = tails[b];
      rt.assign(static_cast<size_t>(n_new[b]), {});
      const int64_t base = starts[b] + chain;  // node j was written at slot row base + j
      for (int64_t j = 0; j < nodes; ++j) {
        TORCH_CHECK(parents[j] < j && parents[j] >= -1, "a tree's parent comes before its child");
        std::vector<int64_t> path;
        for (int64_t a = j; a >= 0; a = parents[a]) path.push_back(base + a);
        rt[chain + j].assign(path.rbegin(), path.rend());
      }
    }
    return tails;
  }

  // `run` where every query attends alone and every product writes into a buffer (`raw_`): the same operations
  // on the same values (RMSNorm and the products into buffers, the attention through `attend_alone`, the residual
  // adds in place, SiLU and its product through ATen on views of the buffers), without a tensor a layer: one
  // workspace for every layer.
  torch::Tensor run_raw(torch::Tensor x, const std::vector<torch::Tensor>& coss, const std::vector<torch::Tensor>& sins,
                        const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                        const std::vector<int64_t>& starts, const std::vector<int64_t>& n_new, const Trees& tails,
                        int64_t count, const std::vector<int64_t>& capture, std::vector<torch::Tensor>& kept) const {
    const int64_t rows = x.size(0), n = x.size(1), D = x.size(2), T = rows * n;
    const int64_t width = (n_heads_ + 2 * n_kv_) * head_dim_, heads = n_heads_ * head_dim_;
    const int64_t inner = count > 0 ? layers_[0].down.in_features : 0;
    TORCH_CHECK(count == 0 || layers_[0].o.out_rows == D, "run: x must be (rows, n, D) with D the layers' width");
    auto work = at::empty({T * (D + width + 2 * heads + 3 * inner + D)}, x.options());
    float* h = work.data_ptr<float>();
    float* qkv = h + T * D;
    float* qbuf = qkv + T * width;
    float* att = qbuf + T * heads;
    float* gu = att + T * heads;
    float* act = gu + T * 2 * inner;
    float* y = act + T * inner;
    // the views SiLU and its product read and write (as `mlp` computes them on chunk(2, -1) of gate_up's output)
    const auto gu_t = work.narrow(0, T * (D + width + 2 * heads), T * 2 * inner).view({rows, n, 2 * inner});
    const auto halves = gu_t.chunk(2, -1);
    auto act_t = work.narrow(0, T * (D + width + 2 * heads + 2 * inner), T * inner).view({rows, n, inner});
    float* px = x.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) {
      const Layer& w = layers_[i];
      rms_norm_into(px, w.in_norm.data_ptr<float>(), h, T, D, eps_);
      w.qkv.into(h, T, qkv);
      heads_extras(w, qkv, T);
      if (rows > 1) std::fill(att, att + T * heads, 0.0f);  // padding positions (as `attention_alone`'s zeros)
      attend_alone(i, qkv, rows, n, coss[w.rope], sins[w.rope], keys, values, starts, n_new, tails, qbuf, att);
      w.o.into(att, T, y);
      if (w.attn_out_norm.defined()) rms_norm_into(y, w.attn_out_norm.data_ptr<float>(), y, T, D, eps_);
      for (int64_t j = 0; j < T * D; ++j) px[j] += y[j];
      rms_norm_into(px, w.post_norm.data_ptr<float>(), h, T, D, eps_);
      w.gate_up.into(h, T, gu);
      if (gelu_)
        at::gelu_out(act_t, halves[0], "tanh");
      else
        at::silu_out(act_t, halves[0]);
      at::mul_out(act_t, act_t, halves[1]);
      w.down.into(act, T, y);
      if (w.mlp_out_norm.defined()) rms_norm_into(y, w.mlp_out_norm.data_ptr<float>(), y, T, D, eps_);
      for (int64_t j = 0; j < T * D; ++j) px[j] += y[j];
      for (int64_t c : capture)
        if (c == i) kept.push_back(x.clone());
    }
    return x;
  }

  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight) const {
    return rms_norm_rows(x, weight, eps_);
  }

  // A layer's bias on q|k|v and RMSNorms of each head of q and k, in place on T dense rows of q|k|v (as the Python
  // loop adds the bias and normalizes those heads: the same operations, so the same bits).
  void heads_extras(const Layer& w, float* qkv, int64_t T) const {
    const int64_t width = (n_heads_ + 2 * n_kv_) * head_dim_;
    if (w.qkv_bias.defined()) {
      const float* pb = w.qkv_bias.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < width; ++j) qkv[t * width + j] += pb[j];
    }
    if (w.q_norm.defined()) {
      const float* pq = w.q_norm.data_ptr<float>();
      const float* pk = w.k_norm.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkv + t * width;
        rms_norm_into(row, pq, row, n_heads_, head_dim_, eps_);
        rms_norm_into(row + n_heads_ * head_dim_, pk, row + n_heads_ * head_dim_, n_kv_, head_dim_, eps_);
      }
    }
  }

  torch::Tensor mlp(const torch::Tensor& x, const Layer& w) const {
    auto halves = w.gate_up.mm(norm(x, w.post_norm)).chunk(2, -1);
    auto out = w.down.mm((gelu_ ? at::gelu(halves[0], "tanh") : at::silu(halves[0])) * halves[1]);
    return w.mlp_out_norm.defined() ? norm(out, w.mlp_out_norm) : out;
  }

  // `defaults.attention_block_end`: the end of the prompt block holding a position (multiples of fine_, which
  // `defaults.fine_block` gives, within the first chunk, of chunk_ beyond).
  int64_t block_end(int64_t position) const {
    const int64_t step = position < chunk_ ? fine_ : chunk_;
    return position / step * step + step;
  }

  // `exact_attention`: the leading n - solo queries in causal blocks ending at `block_end`, then each of the last
  // `solo` queries alone; a query alone attends through attend_one (as `attention.one_query` does).
  torch::Tensor exact_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                int64_t start, int64_t solo, bool gqa, int64_t window) const {
    const int64_t n = q.size(2), lead = n - solo;
    std::vector<torch::Tensor> parts;
    const bool scored = window > 0 || scale_ > 0;  // a family's own attention (`llama.scored_attention`'s)
    // one query ending at `end`: over the keys its window holds, with the family's scale
    const auto one = [&](const torch::Tensor& qj, int64_t end) {
      const int64_t lo = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      return attend_one(qj, keys.slice(2, lo), values.slice(2, lo), end - lo, scale_);
    };
    for (int64_t a = 0; a < lead;) {
      const int64_t b = std::min(lead, block_end(start + a) - start);
      if (b - a == 1) {
        parts.push_back(one(q.slice(2, a, b), start + b));
      } else if (scored) {
        const int64_t lo = window > 0 ? std::max<int64_t>(0, start + a - window + 1) : 0, end = start + b;
        const auto kpos = at::arange(lo, end, q.options().dtype(at::kLong)).unsqueeze(0);
        const auto qpos = at::arange(start + a, end, q.options().dtype(at::kLong)).unsqueeze(1);
        auto mask = kpos <= qpos;
        if (window > 0) mask = mask & (kpos > qpos - window);
        const auto kt = keys.slice(2, lo, end).to(q.scalar_type());
        const auto vt = values.slice(2, lo, end).to(q.scalar_type());
        const std::optional<double> sc = scale_ > 0 ? std::optional<double>(scale_) : std::nullopt;
        parts.push_back(at::scaled_dot_product_attention(q.slice(2, a, b), kt, vt, mask, 0.0, false, sc, gqa));
      } else {
        auto mask = at::ones({b - a, start + b}, q.options().dtype(at::kBool)).tril(start + a);
        // a float16 cache's keys and values as float32 (exactly), as the Python loop converts them
        const auto kt = keys.slice(2, 0, start + b).to(q.scalar_type());
        const auto vt = values.slice(2, 0, start + b).to(q.scalar_type());
        parts.push_back(at::scaled_dot_product_attention(q.slice(2, a, b), kt, vt, mask, 0.0, false, std::nullopt, gqa));
      }
      a = b;
    }
    for (int64_t j = lead; j < n; ++j) parts.push_back(one(q.slice(2, j, j + 1), start + j + 1));
    return parts.size() == 1 ? parts[0] : at::cat(parts, 2);
  }

  // Whether every new query of every row attends alone (one-token steps; verification passes, whose scored
  // queries attend as one-token steps): then `attention_alone` computes the layer's attention.
  bool all_alone(const std::vector<int64_t>& n_new, const std::vector<int64_t>& scored) const {
    for (size_t b = 0; b < n_new.size(); ++b)
      if (n_new[b] < 1 || (n_new[b] > 1 && !(exact_rows_ && scored[b] >= n_new[b]))) return false;
    return true;
  }

  // `attention` where every query attends alone, on raw buffers: the rotary positions of each new query and key
  // (rope_heads' arithmetic), keys and values written into each row's slot, each query head through attend_head
  // (attend_one's arithmetic), the heads laid out as the output product reads them. The same bits as `attention`
  // without its views, copies and a transpose (tested against the Python loop).
  torch::Tensor attention_alone(int64_t i, const torch::Tensor& h, const torch::Tensor& cos,
                                const torch::Tensor& sin_signed, const std::vector<torch::Tensor>& keys,
                                const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& n_new, const Trees& tails) const {
    const int64_t rows = h.size(0), n = h.size(1), hd = head_dim_, Hq = n_heads_;
    const Layer& w = layers_[i];
    const auto qkv = w.qkv.mm(h).contiguous();  // (rows, n, width), this call's own
    TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.stride(3) == 1 && sin_signed.stride(3) == 1,
                "attention_alone: float32, dense rotary rows");
    heads_extras(w, qkv.data_ptr<float>(), rows * n);
    auto qbuf = at::empty({rows, n, Hq, hd}, qkv.options());
    auto out = rows > 1 ? at::zeros({rows, n, Hq, hd}, qkv.options()) : at::empty({rows, n, Hq, hd}, qkv.options());
    attend_alone(i, qkv.data_ptr<float>(), rows, n, cos, sin_signed, keys, values, starts, n_new, tails,
                 qbuf.data_ptr<float>(), out.data_ptr<float>());
    auto y = w.o.mm(out.view({rows, n, Hq * hd}));
    return w.attn_out_norm.defined() ? norm(y, w.attn_out_norm) : y;
  }

  // The attention of layer i where every new query attends alone, from its qkv rows src (rows, n, width) on raw
  // buffers: the rotary positions of each new query and key (rope_heads' arithmetic) into qd (rows, n, Hq, hd) and
  // each row's slot, values written into the slot, each query head through attend_head (attend_one's arithmetic)
  // into od (rows, n, Hq, hd), laid out as the output product reads them; padding positions of od untouched.
  void attend_alone(int64_t i, const float* src, int64_t rows, int64_t n, const torch::Tensor& cos,
                    const torch::Tensor& sin_signed, const std::vector<torch::Tensor>& keys,
                    const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& n_new, const Trees& tails, float* qd, float* od) const {
    const auto kv_type = keys.empty() ? at::kFloat : keys[0].scalar_type();
    for (int64_t b = 0; b < rows; ++b)
      TORCH_CHECK(keys[b].scalar_type() == kv_type && values[b].scalar_type() == kv_type,
                  "attention_alone: every row's keys and values of one dtype");
    if (kv_type == at::kHalf)
      attend_alone_as<c10::Half>(i, src, rows, n, cos, sin_signed, keys, values, starts, n_new, tails, qd, od);
    else
      attend_alone_as<float>(i, src, rows, n, cos, sin_signed, keys, values, starts, n_new, tails, qd, od);
  }

  template <typename KT>
  void attend_alone_as(int64_t i, const float* src, int64_t rows, int64_t n, const torch::Tensor& cos,
                       const torch::Tensor& sin_signed, const std::vector<torch::Tensor>& keys,
                       const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                       const std::vector<int64_t>& n_new, const Trees& tails, float* qd, float* od) const {
    const int64_t hd = head_dim_, Hq = n_heads_, Hkv = n_kv_, group = Hq / Hkv;
    const int64_t width = (Hq + 2 * Hkv) * hd;
    const float* pc = cos.data_ptr<float>();
    const float* ps = sin_signed.data_ptr<float>();
    const int64_t cb = cos.stride(0), ct = cos.stride(2), sb = sin_signed.stride(0), st = sin_signed.stride(2);
    struct Item {
      const KT* keys;
      const KT* values;
      int64_t kt, vt, kh, vh, end;
      const float* q;
      float* y;
      const int64_t* tail;  // a tree node's ancestors and itself (slot rows), after keys [0, end)
      int64_t n_tail;
      int64_t kv;  // the key head it reads
    };
    std::vector<Item> items;
    items.reserve(static_cast<size_t>(rows * n * Hkv));  // an item a key head's queries
    int64_t longest = 0;
    std::vector<KT*> kds(static_cast<size_t>(rows)), vds(static_cast<size_t>(rows));
    for (int64_t b = 0; b < rows; ++b) {
      TORCH_CHECK(keys[b].stride(3) == 1 && values[b].stride(3) == 1, "attention_alone: dense key rows");
      kds[b] = keys[b].data_ptr<KT>() + i * keys[b].stride(0);  // (L, Hkv, T, hd): this layer's
      vds[b] = values[b].data_ptr<KT>() + i * values[b].stride(0);
    }
    // Each new token's rotary queries and its keys and values written into its row's slot: rows in parallel
    // where there are many (each element's arithmetic is its own; rows write their own slots).
    const auto place = [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        KT* kd = kds[b];
        KT* vd = vds[b];
        const int64_t kh = keys[b].stride(1), kt = keys[b].stride(2);
        const int64_t vh = values[b].stride(1), vt = values[b].stride(2);
        for (int64_t t = 0; t < n_new[b]; ++t) {
          const float* x = src + (b * n + t) * width;
          const float* c = pc + b * cb + t * ct;
          const float* sn = ps + b * sb + t * st;
          const int64_t pos = starts[b] + t;
          for (int64_t head = 0; head < Hq; ++head)
            rope_head(x + head * hd, c, sn, hd, qd + ((b * n + t) * Hq + head) * hd);
          float key[256];
          for (int64_t head = 0; head < Hkv; ++head) {
            rope_head(x + (Hq + head) * hd, c, sn, hd, key);
            KT* kr = kd + head * kh + pos * kt;
            KT* vr = vd + head * vh + pos * vt;
            const float* vx = x + (Hq + Hkv + head) * hd;
            for (int64_t d = 0; d < hd; ++d) store_as(key[d], kr + d), store_as(vx[d], vr + d);
          }
        }
      }
    };
    if (rows >= 8)
      at::parallel_for(0, rows, 4, place);
    else
      place(0, rows);
    for (int64_t b = 0; b < rows; ++b) {
      KT* kd = kds[b];
      KT* vd = vds[b];
      const int64_t kh = keys[b].stride(1), kt = keys[b].stride(2);
      const int64_t vh = values[b].stride(1), vt = values[b].stride(2);
      const auto& rt = tails.empty() ? kNoTails : tails[b];  // per new token: its tail (empty: causal)
      int64_t chain = 0;  // a tree row's chain: its new tokens before the first node
      while (chain < static_cast<int64_t>(rt.size()) && rt[chain].empty()) ++chain;
      // The row's queries in the order that keeps each key head's keys and values in the core's caches: by key
      // head, then by new token, then by the query heads that read it (each query's arithmetic is its own, so
      // the order changes no bit; it spares re-reading a layer's whole cache from memory for each scored token).
      for (int64_t kv = 0; kv < Hkv; ++kv)
        for (int64_t t = 0; t < n_new[b]; ++t) {
          const bool node = t < static_cast<int64_t>(rt.size()) && !rt[t].empty();
          const int64_t end = node ? starts[b] + chain : starts[b] + t + 1;  // a node: the cache and the chain,
          // (a window: the keys [lo, end) it holds; trees never meet windows here, see `run`)
          const int64_t lo = layers_[i].window > 0 ? std::max<int64_t>(0, end - layers_[i].window) : 0;
          const int64_t n_tail = node ? static_cast<int64_t>(rt[t].size()) : 0;  // then its tail
          // one item a key head's query heads (consecutive in qd and od): attended together where attend_heads
          // applies, else one by one
          const int64_t head = kv * group;
          items.push_back(Item{kd + lo * kt, vd + lo * vt, kt, vt, kh, vh, end - lo, qd + ((b * n + t) * Hq + head) * hd,
                               od + ((b * n + t) * Hq + head) * hd, node ? rt[t].data() : nullptr, n_tail, kv});
          longest = std::max(longest, end - lo + n_tail);
        }
    }
    const int64_t padded = (longest + 7) / 8 * 8;
    const float scale = scale_ > 0 ? scale_ : 1.0f / std::sqrt(static_cast<float>(hd));
    const auto count = static_cast<int64_t>(items.size());
    const int64_t grain =
        std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * hd * longest * group));
#ifdef __AVX2__
    const bool grouped = (hd == 64 || hd == 128) && group >= 2 && group <= 4;
#else
    const bool grouped = false;
#endif
    at::parallel_for(0, count, grain, [&](int64_t j0, int64_t j1) {
      std::vector<float> p(static_cast<size_t>(padded * group));
      std::vector<float> acc(static_cast<size_t>(hd * group));
      for (int64_t j = j0; j < j1; ++j) {
        const Item& it = items[j];
        const KT* kb = it.keys + it.kv * it.kh;
        const KT* vb = it.values + it.kv * it.vh;
        if (grouped) {
#ifdef __AVX2__
          const float* qs[4];
          float* ys[4];
          for (int64_t g = 0; g < group; ++g) qs[g] = it.q + g * hd, ys[g] = it.y + g * hd;
          attend_group<KT>(group, hd)(qs, kb, it.kt, vb, it.vt, it.end, scale, padded, p.data(), acc.data(), ys,
                                      it.tail, it.n_tail);
#endif
        } else {
          for (int64_t g = 0; g < group; ++g)
            attend_head(it.q + g * hd, kb, it.kt, vb, it.vt, it.end, hd, scale, p.data(), acc.data(), it.y + g * hd,
                        it.tail, it.n_tail);
        }
      }
    });
  }

  torch::Tensor attention(int64_t i, const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                          const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& n_new,
                          const std::vector<int64_t>& scored, const Trees& tails) const {
    if (all_alone(n_new, scored)) return attention_alone(i, h, cos, sin_signed, keys, values, starts, n_new, tails);
    const int64_t rows = h.size(0), n = h.size(1), hd = head_dim_;
    const Layer& w = layers_[i];
    auto qkv = w.qkv.mm(h).contiguous();  // (B, n, width), this call's own
    heads_extras(w, qkv.data_ptr<float>(), rows * n);
    auto heads = qkv.view({rows, n, -1, hd}).transpose(1, 2);  // (B, Hq + 2 Hkv, n, hd)
    auto qk = rope_heads(heads.slice(1, 0, n_heads_ + n_kv_), cos, sin_signed);
    auto q = qk.slice(1, 0, n_heads_), k = qk.slice(1, n_heads_);
    auto v = heads.slice(1, n_heads_ + n_kv_);
    const bool gqa = n_kv_ != n_heads_;
    torch::Tensor out;
    if (rows > 1) out = at::zeros_like(q);
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t start = starts[b], count = n_new[b];
      auto layer_keys = keys[b].select(0, i), layer_values = values[b].select(0, i);
      layer_keys.slice(1, start, start + count).copy_(k.select(0, b).slice(1, 0, count));
      layer_values.slice(1, start, start + count).copy_(v.select(0, b).slice(1, 0, count));
      const int64_t solo = exact_rows_ && count > 1 ? std::min(scored[b], count) : 0;
      auto one = exact_attention(q.slice(0, b, b + 1).slice(2, 0, count), layer_keys.unsqueeze(0),
                                 layer_values.unsqueeze(0), start, solo, gqa, w.window);
      if (rows == 1)
        out = one;
      else
        out.slice(0, b, b + 1).slice(2, 0, count).copy_(one);
    }
    auto y = w.o.mm(out.transpose(1, 2).reshape({rows, n, n_heads_ * hd}));
    return w.attn_out_norm.defined() ? norm(y, w.attn_out_norm) : y;
  }

  int64_t n_heads_, n_kv_, head_dim_;
  double eps_;
  int64_t chunk_, fine_;
  bool exact_rows_;
  std::vector<Layer> layers_;
  bool raw_ = true;  // every layer's products write into buffers (`run_raw`)
  bool gelu_ = false;  // GeGLU rather than SwiGLU
  float scale_ = 0.0f;  // the attention's scale (0: 1/sqrt(head size))
};

}  // namespace

// The layer loop's entry points, added to the extension's module by qgemm.cpp.
void register_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Product>(m, "Product")
      .def(py::init([](int64_t kind, torch::Tensor weight, int64_t fmt, std::vector<torch::Tensor> packed,
                       std::vector<torch::Tensor> scales_zeros, int64_t out_rows, int64_t in_features, bool solo) {
             TORCH_CHECK(kind >= FLOAT && kind <= BLOCKS16, "unknown product kind ", kind);
             TORCH_CHECK(packed.size() == scales_zeros.size(), "one scales_zeros per packed plane");
             TORCH_CHECK(kind != INT4_TORCH || !packed.empty(), "an int4 product needs its planes");
             return Product{kind, weight, fmt, packed, scales_zeros, out_rows, in_features, solo};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("fmt"), py::arg("packed"), py::arg("scales_zeros"),
           py::arg("out_rows"), py::arg("in_features"), py::arg("solo"))
      .def("mm", &Product::mm, "x (..., K) @ W.T -> (..., out_rows), as LlamaWeights._mm computes it");
  m.def("residual_mlps", &residual_mlps, "an eagle's step: x + down(silu(up([x; extra]))), then x + down(silu(up(x)))",
        py::arg("ups"), py::arg("downs"), py::arg("x"), py::arg("extra"));
  m.def("rms_norm", &rms_norm_rows, "RMSNorm of each row of x (..., D) float32, one fixed order a row",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("attend_one", &attend_one, "one query (1, Hq, 1, hd) over the first `end` keys (1, Hkv, T, hd), float32",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("end"), py::arg("scale") = 0.0);
  m.def("rope_heads", &rope_heads, "x * cos + roll(x, hd/2) * sin_signed for heads (B, H, n, hd)", py::arg("heads"),
        py::arg("cos"), py::arg("sin_signed"));
  py::class_<Stack>(m, "Stack")
      .def(py::init<int64_t, int64_t, int64_t, double, int64_t, int64_t, bool>(), py::arg("n_heads"),
           py::arg("n_kv"), py::arg("head_dim"), py::arg("eps"), py::arg("chunk"), py::arg("fine"),
           py::arg("exact_rows"))
      .def("add_layer", &Stack::add_layer)
      .def("set_family", &Stack::set_family, py::arg("gelu"), py::arg("scale"))
      .def("set_extras", &Stack::set_extras, py::arg("qkv_bias"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("attn_out_norm"), py::arg("mlp_out_norm"), py::arg("window"), py::arg("rope"))
      .def("__len__", &Stack::size)
      .def_property_readonly("raw", &Stack::raw,
                             "whether its layers run on buffers where every query attends alone (run_raw)")
      .def("run", &Stack::run, py::arg("x"), py::arg("cos"), py::arg("sin_signed"), py::arg("keys"),
           py::arg("values"), py::arg("starts"), py::arg("n_new"), py::arg("scored"), py::arg("n_layers"),
           py::arg("capture"), py::arg("trees") = std::vector<std::vector<int64_t>>{},
           py::arg("more_cos") = std::vector<torch::Tensor>{}, py::arg("more_sin") = std::vector<torch::Tensor>{},
           py::call_guard<py::gil_scoped_release>());
}
