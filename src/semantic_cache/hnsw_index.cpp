// The one C++ translation unit of blade: hnswlib (Debian's libhnswlib-dev, header-only)
// behind the C interface of hnsw_index.h. Every hnswlib call is wrapped so no exception
// crosses into C.
//
// hnswlib's own SIMD is chosen at compile time from -m flags (and its SSE prefetches read a
// word past full neighbour lists), so it is turned off: the distance is blade's dot product,
// dispatched at run time like every other kernel.
#define NO_MANUAL_VECTORIZATION
#include <hnswlib/hnswlib.h>

#include <exception>
#include <memory>
#include <new>

extern "C" {
#include "blade/kernels.h"
#include "semantic_cache/hnsw_index.h"
}

namespace {

float inner_product_distance(const void *a, const void *b, const void *dim)
{
    return 1.0f - blade_dot_f32(static_cast<const float *>(a), static_cast<const float *>(b),
                                static_cast<int64_t>(*static_cast<const size_t *>(dim)));
}

class InnerProductSpace : public hnswlib::SpaceInterface<float> {
public:
    explicit InnerProductSpace(size_t dim) : dim_(dim) {}
    size_t get_data_size() override { return dim_ * sizeof(float); }
    hnswlib::DISTFUNC<float> get_dist_func() override { return inner_product_distance; }
    void *get_dist_func_param() override { return &dim_; }

private:
    size_t dim_;
};

} // namespace

struct sc_hnsw {
    InnerProductSpace space;
    std::unique_ptr<hnswlib::HierarchicalNSW<float>> graph;
    int32_t dim;
    sc_hnsw(int32_t d) : space(static_cast<size_t>(d)), dim(d) {}
};

extern "C" sc_hnsw *sc_hnsw_new(int32_t dim, size_t capacity, int32_t m, int32_t ef_construction, int32_t ef_search,
                                blade_error *err)
{
    try {
        std::unique_ptr<sc_hnsw> h(new sc_hnsw(dim));
        h->graph.reset(new hnswlib::HierarchicalNSW<float>(&h->space, capacity < 16 ? 16 : capacity,
                                                           static_cast<size_t>(m),
                                                           static_cast<size_t>(ef_construction)));
        h->graph->setEf(static_cast<size_t>(ef_search));
        return h.release();
    } catch (const std::exception &e) {
        blade_error_set(err, "HNSW index: %s", e.what());
    } catch (...) {
        blade_error_set(err, "HNSW index: unknown failure");
    }
    return nullptr;
}

extern "C" void sc_hnsw_free(sc_hnsw *h)
{
    delete h;
}

extern "C" int sc_hnsw_add(sc_hnsw *h, const float *v, uint64_t label, blade_error *err)
{
    try {
        auto &g = *h->graph;
        if (g.cur_element_count >= g.max_elements_)
            g.resizeIndex(g.max_elements_ * 2);
        g.addPoint(v, static_cast<hnswlib::labeltype>(label));
        return 0;
    } catch (const std::exception &e) {
        return blade_error_set(err, "HNSW index: %s", e.what());
    } catch (...) {
        return blade_error_set(err, "HNSW index: unknown failure");
    }
}

extern "C" int sc_hnsw_remove(sc_hnsw *h, uint64_t label)
{
    try {
        h->graph->markDelete(static_cast<hnswlib::labeltype>(label));
        return 0;
    } catch (...) {
        return -1;
    }
}

extern "C" int sc_hnsw_nearest(const sc_hnsw *h, const float *q, uint64_t *label, float *similarity)
{
    try {
        const auto &g = *h->graph;
        auto found = g.searchKnn(q, 1);
        if (found.empty())
            return 1;
        *label = found.top().second;
        const float *v = sc_hnsw_vector(h, *label);
        if (!v)
            return -1;
        // the exact product again rather than 1 - distance, which rounds
        *similarity = blade_dot_f32(q, v, h->dim);
        return 0;
    } catch (...) {
        return -1;
    }
}

extern "C" const float *sc_hnsw_vector(const sc_hnsw *h, uint64_t label)
{
    const auto &g = *h->graph;
    auto it = g.label_lookup_.find(static_cast<hnswlib::labeltype>(label));
    if (it == g.label_lookup_.end())
        return nullptr;
    return reinterpret_cast<const float *>(g.getDataByInternalId(it->second));
}

extern "C" size_t sc_hnsw_overhead_bytes(const sc_hnsw *h)
{
    const auto &g = *h->graph;
    size_t nodes = g.max_elements_;
    // level 0 (links, vector, label) for every node the graph has room for; per node a lock,
    // its level, its upper-links pointer and a visited mark of one search
    size_t total = nodes * (g.size_data_per_element_ + sizeof(std::mutex) + sizeof(int) + sizeof(char *) +
                            sizeof(hnswlib::vl_type));
    for (size_t i = 0; i < g.cur_element_count; i++)
        if (g.element_levels_[i] > 0)
            total += g.size_links_per_element_ * static_cast<size_t>(g.element_levels_[i]) + 1;
    // label -> node map: a node of key, value and next pointer, and a bucket pointer
    total += g.label_lookup_.size() * (sizeof(void *) * 2 + sizeof(hnswlib::labeltype) + sizeof(hnswlib::tableint)) +
             g.label_lookup_.bucket_count() * sizeof(void *);
    total += g.link_list_update_locks_.size() * sizeof(std::mutex);
    // the live vectors are counted as the entries' own bytes
    return total - (g.cur_element_count - g.num_deleted_) * g.data_size_;
}
