/* `blade serve`'s embedding and semantic cache flags (serve_cache.h). */

#include "cli/serve_cache.h"

#include "blade/model.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

void cli_serve_cache_init(cli_serve_cache *o)
{
    memset(o, 0, sizeof *o);
    blade_semcache_config d = blade_semcache_config_default(0);
    o->pooling = BLADE_POOL_MODEL;
    o->threshold = d.threshold;
    o->ttl_s = d.ttl_s;
    o->max_entries = d.max_entries;
    o->max_bytes = (size_t)d.max_bytes;
    o->index = d.index;
}

static const cli_choice poolings[] = {
    {"model", BLADE_POOL_MODEL}, {"mean", BLADE_POOL_MEAN}, {"last", BLADE_POOL_LAST}, {0}};
static const cli_choice indexes[] = {
    {"auto", BLADE_SEMCACHE_INDEX_AUTO}, {"exact", BLADE_SEMCACHE_INDEX_EXACT}, {"hnsw", BLADE_SEMCACHE_INDEX_HNSW}, {0}};

#define C cli_serve_cache
const cli_flag cli_serve_cache_flags[] = {
    CLI_SECTION("embeddings (POST /v1/embeddings)"),
    {.name = "embed-model", .kind = CLI_PATH, CLI_AT(C, embed_model_path), .metavar = "FILE",
     .dflt = "the served model", .help = "GGUF model for embeddings and the semantic cache's similarity"},
    {.name = "embed-pooling", .kind = CLI_ENUM, CLI_AT(C, pooling), .choices = poolings,
     .help = "model: the GGUF's {arch}.pooling_type key, else mean; mean or last token"},
    CLI_SECTION("semantic cache"),
    {.name = "semantic-cache", .kind = CLI_BOOL, CLI_AT(C, on),
     .help = "answer repeated requests (exact tier) and near-repeats (cosine similarity of the prompts' "
             "embeddings) without running the model; per tenant (bearer key + cache_salt); only greedy "
             "answers that ended with stop, or requests with \"semantic_cache\": true, are stored, and "
             "\"semantic_cache\": false bypasses it"},
    {.name = "semantic-threshold", .kind = CLI_DOUBLE, CLI_AT(C, threshold), .min = 1e-6, .max = 1, .metavar = "X",
     .help = "cosine similarity a semantic hit needs"},
    {.name = "semantic-cache-entries", .kind = CLI_INT, CLI_AT(C, max_entries), .min = 1, .max = 1LL << 32,
     .metavar = "N", .help = "capacity in entries"},
    {.name = "semantic-cache-size", .kind = CLI_SIZE, CLI_AT(C, max_bytes), .min = 4096, .max = 0x1p40,
     .metavar = "SIZE", .help = "capacity in bytes (K/M/G suffix)"},
    {.name = "semantic-cache-ttl", .kind = CLI_DOUBLE, CLI_AT(C, ttl_s), .min = 0, .max = 1e9, .metavar = "SECONDS",
     .help = "entries expire this long after being stored; 0 = never"},
    {.name = "semantic-cache-db", .kind = CLI_PATH, CLI_AT(C, db_path), .metavar = "FILE",
     .help = "persist to this SQLite file (a damaged one is moved aside with a warning and the cache starts "
             "empty)"},
    {.name = "semantic-cache-index", .kind = CLI_ENUM, CLI_AT(C, index), .choices = indexes,
     .help = "auto: an exact scan while a partition is small, an HNSW graph (hnswlib) when large"},
    {0},
};
#undef C

/* The embedder's name: a digest of the embedding model's metadata and tensor table, and
 * the pooling, so a database written with other vectors is set aside. */
static void embedder_name(const blade_model *m, blade_pooling pooling, char *out, size_t cap)
{
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_Digest(m->file->map, m->file->data_offset, d, &n, EVP_sha256(), NULL);
    snprintf(out, cap, "blade:%02x%02x%02x%02x%02x%02x%02x%02x:%s", d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7],
             blade_pooling_name(pooling));
}

int cli_serve_cache_start(cli_serve_cache *o, api_model *am, const cli_engine_options *eo, blade_error *err)
{
    am->pooling = o->pooling;
    if (o->embed_model_path) {
        if (!(o->embed_model = blade_model_load(o->embed_model_path, err)))
            return blade_error_prefix(err, "--embed-model");
        cli_engine_options eeo = *eo;
        eeo.cfg.max_context = 0; /* the embedding model's own */
        cli_engine_finalize(&eeo, o->embed_model);
        if (!(o->embed_engine = blade_engine_new(o->embed_model, &eeo.cfg, err)))
            return blade_error_prefix(err, "--embed-model");
        api_model_set_embedder(am, o->embed_engine);
    }
    if (!o->on)
        return 0;
    blade_pooling resolved = o->pooling == BLADE_POOL_MODEL ? blade_engine_pooling(am->embed_engine) : o->pooling;
    embedder_name(am->embed_model, resolved, o->embedder, sizeof o->embedder);
    o->cfg = blade_semcache_config_default(am->embed_model->hp.n_embd);
    o->cfg.embedder = o->embedder;
    o->cfg.threshold = (float)o->threshold;
    o->cfg.ttl_s = o->ttl_s;
    o->cfg.max_entries = o->max_entries;
    o->cfg.max_bytes = (int64_t)o->max_bytes;
    o->cfg.index = o->index;
    o->cfg.db_path = o->db_path;
    if (!(o->cache = blade_semcache_open(&o->cfg, err)))
        return blade_error_prefix(err, "--semantic-cache");
    return 0;
}

void cli_serve_cache_describe(FILE *out, const cli_serve_cache *o, const api_model *am)
{
    blade_pooling p = am->pooling == BLADE_POOL_MODEL ? blade_engine_pooling(am->embed_engine) : am->pooling;
    fprintf(out, "embeddings: %s, %s pooling, %d dimensions\n",
            o->embed_model_path ? o->embed_model_path : "the served model", blade_pooling_name(p),
            am->embed_model->hp.n_embd);
    if (!o->cache) {
        fprintf(out, "semantic cache: off\n");
        return;
    }
    blade_semcache_stats st;
    blade_semcache_get_stats(o->cache, &st);
    fprintf(out, "semantic cache: threshold %g, %lld entries or %lld KiB, TTL %g s, %s%s; %lld entries loaded\n",
            (double)o->cfg.threshold, (long long)o->cfg.max_entries, (long long)(o->cfg.max_bytes >> 10), o->cfg.ttl_s,
            o->cfg.db_path ? "database " : "memory only", o->cfg.db_path ? o->cfg.db_path : "", (long long)st.entries);
}

void cli_serve_cache_stop(cli_serve_cache *o)
{
    blade_semcache_close(o->cache);
    blade_engine_free(o->embed_engine, false);
    blade_model_free(o->embed_model);
    o->cache = NULL;
    o->embed_engine = NULL;
    o->embed_model = NULL;
}
