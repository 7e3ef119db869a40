// Megatron-Core torch_dist layer-stacked tensors, split into one tensor per layer (and expert).
//
// Megatron-Core's TransformerBlock saves each per-layer tensor of a homogeneous block under one
// key without the layer index, with a layer axis prepended to the global shape (0.16:
// `decoder.layers.self_attention.linear_qkv.weight` of [n_layers, 3 * ..., hidden]; every
// layer's chunk has size 1 along it). SequentialMLP experts prepend an expert axis after it
// (0.16: `decoder.layers.mlp.experts.experts.linear_fc1.weight` of [n_layers, n_experts, ...],
// the global expert index). Megatron's model.state_dict(), and so the pattern rules and the
// target views, name each layer (`decoder.layers.<i>.`) and expert
// (`mlp.experts.local_experts.<j>.`, j global here). A `layers`, `local_experts`, or second
// `experts` (written `local_experts.<j>`) key component not followed by a number marks one
// stacked axis, in key order.
//
// Not for: flattened-range optimizer chunks of several layers (refused), naming beyond the two
// components above, anything about bytes (fragments keep their file offsets).
// Invariants: the split items cover exactly what the stacked item covered; items of one run of
// consecutive stacked items are reordered layer by layer (then expert), in source order within
// an index, which is Megatron's model.state_dict() order; byte items met inside such a run
// follow it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "index/checkpoint.h"

namespace ucpfs::index {

// The number of stacked axes `key` names (0: not stacked).
int StackedAxes(const std::string& key);

// `key` with the indices of `index` (one per stacked axis) written after each stacked
// component: ("decoder.layers.mlp.experts.local_experts.linear_fc1.weight", {2, 1}) ->
// "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"; so does
// "decoder.layers.mlp.experts.experts.linear_fc1.weight".
std::string UnstackedKey(const std::string& key, const std::vector<int64_t>& index);

// Splits every stacked tensor item of `items` (kept as is: byte items, unstacked keys, and a
// tensor with no more dims than its key's stacked axes). Whole-box fragments spanning several
// indices are cut per index; a flattened-range fragment must have size 1 on the stacked axes.
// Errors: kUnsupported naming the item (a flat-range fragment across layers); kCorrupt (a
// split key equal to another item's key).
Result<std::vector<Item>> UnstackMegatronItems(std::vector<Item> items);

}  // namespace ucpfs::index
