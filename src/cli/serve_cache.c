/* `blade serve`'s embedding and semantic cache flags (serve_cache.h). */

#include "cli/serve_cache.h"

#include "blade/model.h"
#include "cli/cli_util.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

void cli_serve_cache_init(cli_serve_cache *o)
{
    memset(o, 0, sizeof *o);
    o->cfg = blade_semcache_config_default(0);
    o->pooling = BLADE_POOL_MODEL;
}

int cli_serve_cache_option(cli_serve_cache *o, int code, const char *arg)
{
    long long n;
    double x;
    switch (code) {
    case OPT_SEMCACHE: o->on = true; return 1;
    case OPT_SEMCACHE_THRESHOLD:
        if (!cli_parse_float("--semantic-threshold", arg, 1e-6, 1, &x))
            return -1;
        o->cfg.threshold = (float)x;
        return 1;
    case OPT_SEMCACHE_ENTRIES:
        if (!cli_parse_int("--semantic-cache-entries", arg, 1, 1LL << 32, &n))
            return -1;
        o->cfg.max_entries = n;
        return 1;
    case OPT_SEMCACHE_MIB:
        if (!cli_parse_int("--semantic-cache-mib", arg, 1, 1LL << 20, &n))
            return -1;
        o->cfg.max_bytes = n << 20;
        return 1;
    case OPT_SEMCACHE_TTL:
        if (!cli_parse_float("--semantic-cache-ttl", arg, 0, 1e9, &x))
            return -1;
        o->cfg.ttl_s = x;
        return 1;
    case OPT_SEMCACHE_DB: o->cfg.db_path = arg; return 1;
    case OPT_SEMCACHE_INDEX:
        if (!strcmp(arg, "auto"))
            o->cfg.index = BLADE_SEMCACHE_INDEX_AUTO;
        else if (!strcmp(arg, "exact"))
            o->cfg.index = BLADE_SEMCACHE_INDEX_EXACT;
        else if (!strcmp(arg, "hnsw"))
            o->cfg.index = BLADE_SEMCACHE_INDEX_HNSW;
        else
            return fprintf(stderr, "error: --semantic-cache-index expects auto, exact or hnsw, got '%s'\n", arg), -1;
        return 1;
    case OPT_EMBED_MODEL: o->embed_model_path = arg; return 1;
    case OPT_EMBED_POOLING:
        if (!strcmp(arg, "model"))
            o->pooling = BLADE_POOL_MODEL;
        else if (!strcmp(arg, "mean"))
            o->pooling = BLADE_POOL_MEAN;
        else if (!strcmp(arg, "last"))
            o->pooling = BLADE_POOL_LAST;
        else
            return fprintf(stderr, "error: --embed-pooling expects model, mean or last, got '%s'\n", arg), -1;
        return 1;
    default: return 0;
    }
}

void cli_serve_cache_usage(FILE *out)
{
    fprintf(out,
            "embeddings (POST /v1/embeddings) and the semantic cache:\n"
            "      --embed-model FILE   GGUF model for embeddings and the cache's similarity (default:\n"
            "                           the served model)\n"
            "      --embed-pooling P    model (the GGUF's pooling_type key, else mean), mean or last\n"
            "                           (default model)\n"
            "      --semantic-cache     answer repeated requests (exact tier) and near-repeats (cosine\n"
            "                           similarity of the prompts' embeddings) without running the\n"
            "                           model; per tenant (bearer key + cache_salt); only greedy\n"
            "                           answers that ended with stop, or requests with\n"
            "                           \"semantic_cache\": true, are stored; false bypasses it\n"
            "      --semantic-threshold X  cosine similarity a semantic hit needs (default 0.95)\n"
            "      --semantic-cache-entries N  capacity in entries (default 10000)\n"
            "      --semantic-cache-mib N  capacity in MiB (default 256)\n"
            "      --semantic-cache-ttl SECONDS  entries expire after this, 0 = never (default 86400)\n"
            "      --semantic-cache-db FILE  persist to this SQLite file (a damaged one is set aside\n"
            "                           with a warning and the cache starts empty)\n"
            "      --semantic-cache-index I  auto (exact scan while small, HNSW when large), exact or\n"
            "                           hnsw (default auto)\n\n");
}

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
    o->cfg.dim = am->embed_model->hp.n_embd;
    o->cfg.embedder = o->embedder;
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
    fprintf(out, "semantic cache: threshold %g, %lld entries or %lld MiB, TTL %g s, %s%s; %lld entries loaded\n",
            (double)o->cfg.threshold, (long long)o->cfg.max_entries, (long long)(o->cfg.max_bytes >> 20), o->cfg.ttl_s,
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
