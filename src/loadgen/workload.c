/* Traffic for `blade bench serve` (workload.h): synthetic requests or a conversation
 * dataset's turns, what each asks and when it arrives. A request's content is drawn from a
 * random stream keyed by the seed and its session index, so two runs of one seed send the
 * same traffic whatever order requests finish in. */

#include "loadgen/workload.h"

#include "common/file.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Independent random streams, so that adding a draw to one part of a workload never
 * shifts the values of another. */
enum stream {
    STREAM_RANDOM = 1,
    STREAM_PREFIX,
    STREAM_SUFFIX,
    STREAM_MULTI_TURN,
    STREAM_LONG_POSITION,
    STREAM_LONG,
    STREAM_FILE_ORDER,
    STREAM_WARMUP,
    STREAM_SEM_CLASS,
    STREAM_SEM_BASE,
    STREAM_SEM_EDIT,
    STREAM_SEM_FRESH,
};

typedef struct file_entry {
    int32_t *tokens;
    int32_t n_tokens;
    int32_t output_len;
} file_entry;

struct lg_workload {
    lg_workload_config cfg;
    const blade_tokenizer *tok;
    bool bos;
    int32_t *text; /* --text, tokenized without BOS */
    size_t n_text;
    int32_t *pool; /* ordinary vocabulary entries */
    size_t n_pool;
    file_entry *entries; /* file workload, in the seed's shuffled order */
    size_t n_entries, n_skipped;
    char **words; /* semantic workload: the words prompts are made of */
    size_t n_words;
};

static const char *const kind_names[LG_WORKLOAD_COUNT] = {
    [LG_WORKLOAD_RANDOM] = "random",
    [LG_WORKLOAD_SHARED_PREFIX] = "shared-prefix",
    [LG_WORKLOAD_MULTI_TURN] = "multi-turn",
    [LG_WORKLOAD_LONG_INTERFERENCE] = "long-interference",
    [LG_WORKLOAD_FILE] = "file",
    [LG_WORKLOAD_SEMANTIC] = "semantic",
};

const char *lg_label_name(lg_label l)
{
    static const char *const names[LG_LABEL_COUNT] = {"none", "base", "exact", "reword", "near-miss", "fresh"};
    return l < LG_LABEL_COUNT ? names[l] : "?";
}

const char *lg_workload_name(lg_workload_kind k)
{
    return k < LG_WORKLOAD_COUNT ? kind_names[k] : "?";
}

int lg_workload_from_name(const char *name)
{
    for (int k = 0; k < LG_WORKLOAD_COUNT; k++)
        if (!strcmp(name, kind_names[k]))
            return k;
    return -1;
}

static void default_range(lg_range *r, int32_t lo, int32_t hi)
{
    if (r->lo <= 0 && r->hi <= 0) {
        r->lo = lo;
        r->hi = hi;
    }
}

/* Defaults fit a 2048-token context, the smallest the usual small models have. */
void lg_workload_resolve(lg_workload_config *c)
{
    switch (c->kind) {
    case LG_WORKLOAD_SHARED_PREFIX:
        default_range(&c->input_len, 32, 32);
        default_range(&c->output_len, 64, 64);
        break;
    case LG_WORKLOAD_MULTI_TURN:
        default_range(&c->input_len, 64, 64);
        default_range(&c->output_len, 64, 64);
        break;
    case LG_WORKLOAD_LONG_INTERFERENCE:
        default_range(&c->input_len, 32, 32);
        default_range(&c->output_len, 128, 128);
        break;
    case LG_WORKLOAD_SEMANTIC: /* input in words */
        default_range(&c->input_len, 12, 20);
        default_range(&c->output_len, 32, 32);
        if (c->pool <= 0)
            c->pool = 50;
        if (c->exact_share < 0)
            c->exact_share = 0.3;
        if (c->reword_share < 0)
            c->reword_share = 0.3;
        if (c->near_miss_share < 0)
            c->near_miss_share = 0.2;
        break;
    default:
        default_range(&c->input_len, 256, 256);
        default_range(&c->output_len, 128, 128);
        break;
    }
    if (c->groups <= 0)
        c->groups = 4;
    if (c->prompts_per_group <= 0)
        c->prompts_per_group = 16;
    if (c->prefix_len <= 0)
        c->prefix_len = 512;
    if (c->turns <= 0)
        c->turns = 4;
    if (c->long_len <= 0)
        c->long_len = 1536;
    if (c->long_every <= 0)
        c->long_every = 8;
}

/* splitmix64's finaliser: every input bit reaches every output bit, so neighbouring
 * (stream, index) pairs give unrelated seeds. */
static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void stream_rng(const lg_workload *w, enum stream s, uint64_t index, blade_rng *r)
{
    blade_rng_seed(r, mix(mix(mix(w->cfg.seed) ^ (uint64_t)s) ^ index));
}

static int32_t draw(blade_rng *r, lg_range range)
{
    uint64_t span = (uint64_t)(range.hi - range.lo) + 1;
    return range.lo + (int32_t)(blade_rng_next(r) % span);
}

/* n tokens of content: a window of the text at a random place (wrapping at its end), or
 * ordinary vocabulary entries. */
static void fill(const lg_workload *w, blade_rng *r, int32_t *dst, int32_t n)
{
    if (w->n_text) {
        size_t at = (size_t)(blade_rng_next(r) % w->n_text);
        for (int32_t i = 0; i < n; i++)
            dst[i] = w->text[(at + (size_t)i) % w->n_text];
    } else {
        for (int32_t i = 0; i < n; i++)
            dst[i] = w->pool[blade_rng_next(r) % w->n_pool];
    }
}

/* A prompt of exactly n tokens: BOS (when the tokenizer wants one) and n-1 of content. */
static int32_t *prompt(const lg_workload *w, blade_rng *r, int32_t n)
{
    int32_t *t = malloc((size_t)n * sizeof *t);
    if (!t)
        return NULL;
    int32_t b = w->bos ? 1 : 0;
    if (b)
        t[0] = blade_tokenizer_bos(w->tok);
    fill(w, r, t + b, n - b);
    return t;
}

static int load_text(lg_workload *w, blade_error *err)
{
    size_t len = 0;
    char *text = blade_read_file(w->cfg.text_path, &len, err);
    if (!text)
        return -1;
    size_t n = 0;
    int rc = blade_tokenizer_encode(w->tok, text, len, false, false, &w->text, &n, err);
    free(text);
    if (rc)
        return blade_error_prefix(err, "%s", w->cfg.text_path);
    if (n == 0)
        return blade_error_set(err, "%s holds no text", w->cfg.text_path);
    w->n_text = n;
    return 0;
}

static int make_pool(lg_workload *w, blade_error *err)
{
    int32_t n_vocab = blade_tokenizer_n_vocab(w->tok);
    if (!(w->pool = malloc((size_t)n_vocab * sizeof *w->pool)))
        return blade_error_set(err, "out of memory");
    for (int32_t id = 0; id < n_vocab; id++)
        if (blade_tokenizer_attr(w->tok, id) == BLADE_TOKEN_NORMAL && !blade_tokenizer_is_eog(w->tok, id))
            w->pool[w->n_pool++] = id;
    if (!w->n_pool)
        return blade_error_set(err, "the tokenizer has no ordinary tokens to build prompts from");
    return 0;
}

/* ---- the semantic workload ---- */

static int single(lg_session *s, int32_t *tokens, int32_t n, int32_t output_len, blade_error *err);

/* The distinct words prompts are made of: runs of letters in the --text's tokens as text,
 * or in the vocabulary's ordinary entries, three letters or more. */
static int make_words(lg_workload *w, blade_error *err)
{
    const int32_t *ids = w->n_text ? w->text : w->pool;
    size_t n = w->n_text ? w->n_text : w->n_pool;
    size_t cap = blade_tokenizer_max_token_bytes(w->tok) + 8;
    char *piece = malloc(cap);
    char *text = NULL;
    size_t len = 0, text_cap = 0;
    if (!piece)
        return blade_error_set(err, "out of memory");
    blade_detokenizer d;
    blade_detokenizer_init(&d, w->tok, false);
    for (size_t i = 0; i < n; i++) {
        size_t m = blade_detokenizer_push(&d, ids[i], piece, cap);
        if (len + m + 2 > text_cap) {
            text_cap = (len + m + 2) * 2;
            char *grown = realloc(text, text_cap);
            if (!grown) {
                free(text);
                free(piece);
                return blade_error_set(err, "out of memory");
            }
            text = grown;
        }
        memcpy(text + len, piece, m);
        len += m;
        if (!w->n_text)
            text[len++] = ' '; /* vocabulary entries are words of their own */
    }
    free(piece);
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && ((text[j] | 32) >= 'a' && (text[j] | 32) <= 'z'))
            j++;
        if (j - i >= 3) {
            bool seen = false;
            for (size_t k = 0; k < w->n_words && !seen; k++)
                seen = strlen(w->words[k]) == j - i && !strncasecmp(w->words[k], text + i, j - i);
            char **grown = seen ? w->words : realloc(w->words, (w->n_words + 1) * sizeof *grown);
            if (!seen && grown) {
                w->words = grown;
                if ((w->words[w->n_words] = strndup(text + i, j - i)))
                    w->n_words++;
            }
        }
        i = j > i ? j : i + 1;
    }
    free(text);
    if (w->n_words < 16)
        return blade_error_set(err, "the semantic workload needs at least 16 distinct words of 3+ letters in %s, found "
                               "%zu", w->n_text ? w->cfg.text_path : "the vocabulary", w->n_words);
    return 0;
}

/* A prompt as word indices: base b's are drawn from its own stream. */
static int32_t base_words(const lg_workload *w, uint64_t stream_index, enum stream st, int32_t *out)
{
    blade_rng r;
    stream_rng(w, st, stream_index, &r);
    int32_t n = draw(&r, w->cfg.input_len);
    for (int32_t i = 0; i < n; i++)
        out[i] = (int32_t)(blade_rng_next(&r) % w->n_words);
    return n;
}

/* The words as a sentence: the first capitalised, a question mark at the end; a reworded
 * prompt may change both. */
static char *words_text(const lg_workload *w, const int32_t *ix, int32_t n, bool lower_first, const char *end)
{
    size_t len = 0;
    for (int32_t i = 0; i < n; i++)
        len += strlen(w->words[ix[i]]) + 1;
    char *t = malloc(len + strlen(end) + 1);
    if (!t)
        return NULL;
    size_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t m = strlen(w->words[ix[i]]);
        memcpy(t + at, w->words[ix[i]], m);
        if (i == 0)
            t[at] = (char)(lower_first ? (t[at] | 32) : (t[at] & ~32));
        else
            for (size_t k = 0; k < m; k++)
                t[at + k] = (char)(t[at + k] | 32);
        at += m;
        if (i + 1 < n)
            t[at++] = ' ';
    }
    strcpy(t + at, end);
    return t;
}

static lg_label semantic_label(const lg_workload *w, int64_t index)
{
    const lg_workload_config *c = &w->cfg;
    if (index < c->pool)
        return LG_LABEL_BASE;
    blade_rng r;
    stream_rng(w, STREAM_SEM_CLASS, (uint64_t)index, &r);
    double u = blade_rng_uniform(&r);
    if (u < c->exact_share)
        return LG_LABEL_EXACT;
    if (u < c->exact_share + c->reword_share)
        return LG_LABEL_REWORD;
    if (u < c->exact_share + c->reword_share + c->near_miss_share)
        return LG_LABEL_NEAR_MISS;
    return LG_LABEL_FRESH;
}

/* Request `index`: a base prompt (the first pool requests), or by its drawn class one of
 * them repeated, reworded or nearly missed, or a fresh prompt. */
static int semantic(const lg_workload *w, int64_t index, lg_session *s, blade_error *err)
{
    const lg_workload_config *c = &w->cfg;
    lg_label label = semantic_label(w, index);
    int32_t *ix = malloc((size_t)(c->input_len.hi + 1) * sizeof *ix);
    if (!ix)
        return blade_error_set(err, "out of memory");
    blade_rng r;
    stream_rng(w, STREAM_SEM_EDIT, (uint64_t)index, &r);
    uint64_t base = label == LG_LABEL_BASE ? (uint64_t)index : blade_rng_next(&r) % (uint64_t)c->pool;
    int32_t n = label == LG_LABEL_FRESH ? base_words(w, (uint64_t)index, STREAM_SEM_FRESH, ix)
                                        : base_words(w, base, STREAM_SEM_BASE, ix);
    bool lower_first = false;
    const char *end = "?";
    if (label == LG_LABEL_REWORD) {
        /* one or two edits that keep the question: swap two neighbours, casing, punctuation */
        int edits = 1 + (int)(blade_rng_next(&r) % 2);
        for (int e = 0; e < edits; e++) {
            switch (blade_rng_next(&r) % 3) {
            case 0: {
                int32_t i = n > 1 ? (int32_t)(blade_rng_next(&r) % (uint64_t)(n - 1)) : 0;
                int32_t t = ix[i];
                ix[i] = ix[i + (n > 1)];
                ix[i + (n > 1)] = t;
                break;
            }
            case 1: lower_first = true; break;
            default: end = blade_rng_next(&r) % 2 ? "" : " ?"; break;
            }
        }
    } else if (label == LG_LABEL_NEAR_MISS) {
        int32_t i = (int32_t)(blade_rng_next(&r) % (uint64_t)n);
        int32_t other;
        do
            other = (int32_t)(blade_rng_next(&r) % w->n_words);
        while (other == ix[i]);
        ix[i] = other;
    }
    char *text = words_text(w, ix, n, lower_first, end);
    free(ix);
    if (!text)
        return blade_error_set(err, "out of memory");
    int32_t *tokens = NULL;
    size_t n_tokens = 0;
    int rc = blade_tokenizer_encode(w->tok, text, strlen(text), w->bos, false, &tokens, &n_tokens, err);
    free(text);
    if (rc)
        return -1;
    stream_rng(w, STREAM_SEM_BASE, base, &r); /* the answer's length goes with the question */
    if (single(s, tokens, (int32_t)n_tokens, draw(&r, c->output_len), err))
        return -1;
    s->turns[0].label = label;
    return 0;
}

static const char *turn_text(json_t *turn, const char *speaker1, const char *speaker2)
{
    const char *from = json_string_value(json_object_get(turn, "from"));
    const char *value = json_string_value(json_object_get(turn, "value"));
    if (!from || !value || (strcmp(from, speaker1) && strcmp(from, speaker2)))
        return NULL;
    return value;
}

/* ShareGPT layout: the first turn must be the human's (the prompt), the second the
 * model's (its length in tokens is how long the answer should be). Conversations that
 * are malformed, too short to be a real exchange or too long for the context are
 * skipped. */
static int load_dataset(lg_workload *w, int32_t max_context, blade_error *err)
{
    json_t *root = blade_read_json(w->cfg.dataset_path, err);
    if (!root)
        return -1;
    int rc = -1;
    size_t n = json_is_array(root) ? json_array_size(root) : 0;
    size_t *order = malloc((n ? n : 1) * sizeof *order);
    if (!json_is_array(root)) {
        blade_error_set(err, "%s: expected a JSON array of conversations", w->cfg.dataset_path);
        goto out;
    }
    if (!order || !(w->entries = calloc(n ? n : 1, sizeof *w->entries))) {
        blade_error_set(err, "out of memory");
        goto out;
    }
    /* Shuffled before tokenizing, so a limit takes a seeded sample of the whole file. */
    blade_rng r;
    stream_rng(w, STREAM_FILE_ORDER, 0, &r);
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)(blade_rng_next(&r) % i);
        size_t t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
    size_t skipped = 0;
    for (size_t k = 0; k < n; k++) {
        if (w->cfg.dataset_limit > 0 && w->n_entries >= (size_t)w->cfg.dataset_limit)
            break;
        json_t *conv = json_object_get(json_array_get(root, order[k]), "conversations");
        const char *human = turn_text(json_array_get(conv, 0), "human", "user");
        const char *gpt = turn_text(json_array_get(conv, 1), "gpt", "assistant");
        if (!human || !gpt) {
            skipped++;
            continue;
        }
        file_entry *e = &w->entries[w->n_entries];
        int32_t *answer = NULL;
        size_t n_prompt = 0, n_answer = 0;
        if (blade_tokenizer_encode(w->tok, human, strlen(human), w->bos, false, &e->tokens, &n_prompt, err) ||
            blade_tokenizer_encode(w->tok, gpt, strlen(gpt), false, false, &answer, &n_answer, err)) {
            free(e->tokens);
            e->tokens = NULL;
            blade_error_prefix(err, "%s", w->cfg.dataset_path);
            goto out;
        }
        free(answer);
        bool fits = max_context <= 0 || n_prompt + n_answer <= (size_t)max_context;
        if (n_prompt < 4 || n_answer < 4 || !fits) {
            free(e->tokens);
            e->tokens = NULL;
            skipped++;
            continue;
        }
        e->n_tokens = (int32_t)n_prompt;
        e->output_len = (int32_t)n_answer;
        w->n_entries++;
    }
    if (!w->n_entries) {
        blade_error_set(err, "%s: none of its %zu conversations is usable (a human turn then a gpt turn, each of "
                        "4 tokens or more, fitting the context)", w->cfg.dataset_path, n);
        goto out;
    }
    w->n_skipped = skipped;
    rc = 0;
out:
    free(order);
    json_decref(root);
    return rc;
}

static int check_range(const char *flag, lg_range r, blade_error *err)
{
    if (r.lo < 1 || r.hi < r.lo)
        return blade_error_set(err, "%s %d:%d: lengths must be at least 1, low end first", flag, r.lo, r.hi);
    return 0;
}

/* The longest prompt + output the workload can make. */
static int64_t longest_request(const lg_workload_config *c)
{
    int64_t in = c->input_len.hi, out = c->output_len.hi;
    switch (c->kind) {
    case LG_WORKLOAD_SHARED_PREFIX: return c->prefix_len + in + out;
    case LG_WORKLOAD_MULTI_TURN: return (int64_t)c->turns * (in + out);
    case LG_WORKLOAD_LONG_INTERFERENCE: return (c->long_len > in ? c->long_len : in) + out;
    case LG_WORKLOAD_SEMANTIC: return 4 * (in + 2) + out; /* a word is a few tokens at most, mostly one */
    default: return in + out;
    }
}

lg_workload *lg_workload_new(const lg_workload_config *cfg, const blade_tokenizer *tok, int32_t max_context,
                             blade_error *err)
{
    lg_workload *w = calloc(1, sizeof *w);
    if (!w)
        return blade_error_set(err, "out of memory"), NULL;
    w->cfg = *cfg;
    lg_workload_resolve(&w->cfg);
    w->tok = tok;
    w->bos = blade_tokenizer_wants_bos(tok);
    const lg_workload_config *c = &w->cfg;
    if (check_range("--input-len", c->input_len, err) || check_range("--output-len", c->output_len, err))
        goto fail;
    if (c->kind == LG_WORKLOAD_LONG_INTERFERENCE && c->long_every < 2) {
        blade_error_set(err, "--long-every must be at least 2");
        goto fail;
    }
    if (c->kind != LG_WORKLOAD_FILE && max_context > 0 && longest_request(c) > max_context) {
        blade_error_set(err,
                        "the %s workload's longest request (%lld prompt + output tokens) does not fit the server's "
                        "context of %d tokens; shorten --input-len/--output-len%s",
                        lg_workload_name(c->kind), (long long)longest_request(c), max_context,
                        c->kind == LG_WORKLOAD_SHARED_PREFIX   ? " or --prefix-len"
                        : c->kind == LG_WORKLOAD_MULTI_TURN    ? " or --turns"
                        : c->kind == LG_WORKLOAD_LONG_INTERFERENCE ? " or --long-len"
                                                               : "");
        goto fail;
    }
    if (make_pool(w, err))
        goto fail;
    if (c->text_path && load_text(w, err))
        goto fail;
    if (c->kind == LG_WORKLOAD_SEMANTIC) {
        if (c->exact_share + c->reword_share + c->near_miss_share > 1 || c->exact_share < 0 || c->reword_share < 0 ||
            c->near_miss_share < 0) {
            blade_error_set(err, "--exact-share, --reword-share and --near-miss-share must each be >= 0 and add up "
                                 "to at most 1");
            goto fail;
        }
        if (make_words(w, err))
            goto fail;
    }
    if (c->kind == LG_WORKLOAD_FILE) {
        if (!c->dataset_path) {
            blade_error_set(err, "the file workload needs --dataset FILE (ShareGPT-style JSON)");
            goto fail;
        }
        if (load_dataset(w, max_context, err))
            goto fail;
    }
    return w;
fail:
    lg_workload_free(w);
    return NULL;
}

void lg_workload_free(lg_workload *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_entries; i++)
        free(w->entries[i].tokens);
    free(w->entries);
    for (size_t i = 0; i < w->n_words; i++)
        free(w->words[i]);
    free(w->words);
    free(w->text);
    free(w->pool);
    free(w);
}

const lg_workload_config *lg_workload_config_of(const lg_workload *w)
{
    return &w->cfg;
}

size_t lg_workload_dataset_size(const lg_workload *w, size_t *skipped)
{
    *skipped = w->n_skipped;
    return w->n_entries;
}

int32_t lg_workload_turns(const lg_workload *w)
{
    return w->cfg.kind == LG_WORKLOAD_MULTI_TURN ? w->cfg.turns : 1;
}

int64_t lg_workload_default_requests(const lg_workload_config *c)
{
    if (c->kind == LG_WORKLOAD_SHARED_PREFIX)
        return (int64_t)c->groups * c->prompts_per_group;
    if (c->kind == LG_WORKLOAD_SEMANTIC)
        return c->pool + 200;
    return 100;
}

static int single(lg_session *s, int32_t *tokens, int32_t n, int32_t output_len, blade_error *err)
{
    s->n_turns = 0;
    if (!tokens || !(s->turns = malloc(sizeof *s->turns))) {
        free(tokens);
        return blade_error_set(err, "out of memory");
    }
    s->turns[0] = (lg_turn){.tokens = tokens, .n_tokens = n, .output_len = output_len};
    s->n_turns = 1;
    return 0;
}

/* Each turn's prompt is the whole conversation so far: earlier user messages and the
 * transcript's answers (not the server's, so the traffic is the same on every server, as
 * when a recorded conversation is replayed) and the new message. */
static int multi_turn(const lg_workload *w, int64_t index, lg_session *s, blade_error *err)
{
    const lg_workload_config *c = &w->cfg;
    blade_rng r;
    stream_rng(w, STREAM_MULTI_TURN, (uint64_t)index, &r);
    int32_t *ctx = malloc((size_t)longest_request(c) * sizeof *ctx);
    s->turns = calloc((size_t)c->turns, sizeof *s->turns);
    s->n_turns = 0;
    if (!ctx || !s->turns) {
        free(ctx);
        return blade_error_set(err, "out of memory");
    }
    int32_t len = 0;
    for (int32_t k = 0; k < c->turns; k++) {
        int32_t user = draw(&r, c->input_len);
        int32_t answer = draw(&r, c->output_len);
        int32_t b = (k == 0 && w->bos) ? 1 : 0;
        if (b)
            ctx[len] = blade_tokenizer_bos(w->tok);
        fill(w, &r, ctx + len + b, user - b);
        len += user;
        lg_turn *t = &s->turns[k];
        if (!(t->tokens = malloc((size_t)len * sizeof *t->tokens))) {
            free(ctx);
            return blade_error_set(err, "out of memory");
        }
        memcpy(t->tokens, ctx, (size_t)len * sizeof *ctx);
        t->n_tokens = len;
        t->output_len = answer;
        s->n_turns++;
        fill(w, &r, ctx + len, answer);
        len += answer;
    }
    free(ctx);
    return 0;
}

int lg_workload_session(const lg_workload *w, int64_t index, lg_session *s, blade_error *err)
{
    const lg_workload_config *c = &w->cfg;
    blade_rng r;
    memset(s, 0, sizeof *s);
    switch (c->kind) {
    case LG_WORKLOAD_RANDOM: {
        stream_rng(w, STREAM_RANDOM, (uint64_t)index, &r);
        int32_t in = draw(&r, c->input_len), out = draw(&r, c->output_len);
        return single(s, prompt(w, &r, in), in, out, err);
    }
    case LG_WORKLOAD_SHARED_PREFIX: {
        blade_rng pr;
        stream_rng(w, STREAM_PREFIX, (uint64_t)(index % c->groups), &pr);
        stream_rng(w, STREAM_SUFFIX, (uint64_t)index, &r);
        int32_t suffix = draw(&r, c->input_len), out = draw(&r, c->output_len);
        int32_t n = c->prefix_len + suffix;
        int32_t *t = prompt(w, &pr, c->prefix_len);
        int32_t *all = t ? realloc(t, (size_t)n * sizeof *t) : NULL;
        if (!all)
            free(t);
        else
            fill(w, &r, all + c->prefix_len, suffix);
        return single(s, all, n, out, err);
    }
    case LG_WORKLOAD_MULTI_TURN:
        if (multi_turn(w, index, s, err)) {
            lg_session_free(s);
            return -1;
        }
        return 0;
    case LG_WORKLOAD_LONG_INTERFERENCE: {
        int64_t block = index / c->long_every;
        stream_rng(w, STREAM_LONG_POSITION, (uint64_t)block, &r);
        bool is_long = index % c->long_every == (int64_t)(blade_rng_next(&r) % (uint64_t)c->long_every);
        stream_rng(w, STREAM_LONG, (uint64_t)index, &r);
        int32_t in = draw(&r, c->input_len), out = draw(&r, c->output_len);
        if (is_long)
            in = c->long_len;
        return single(s, prompt(w, &r, in), in, out, err);
    }
    case LG_WORKLOAD_SEMANTIC: return semantic(w, index, s, err);
    case LG_WORKLOAD_FILE: {
        const file_entry *e = &w->entries[(size_t)index % w->n_entries];
        int32_t *t = malloc((size_t)e->n_tokens * sizeof *t);
        if (t)
            memcpy(t, e->tokens, (size_t)e->n_tokens * sizeof *t);
        return single(s, t, e->n_tokens, e->output_len, err);
    }
    default: return blade_error_set(err, "unknown workload kind %d", (int)c->kind);
    }
}

int lg_workload_warmup(const lg_workload *w, lg_session *s, blade_error *err)
{
    blade_rng r;
    stream_rng(w, STREAM_WARMUP, 0, &r);
    memset(s, 0, sizeof *s);
    return single(s, prompt(w, &r, 16), 16, 4, err);
}

void lg_session_free(lg_session *s)
{
    for (int32_t k = 0; k < s->n_turns; k++)
        free(s->turns[k].tokens);
    free(s->turns);
    memset(s, 0, sizeof *s);
}

/* ---- arrivals ---- */

void lg_arrivals_init(lg_arrivals *a, double rate, double burstiness, uint64_t seed)
{
    a->rate = rate;
    a->shape = burstiness;
    a->t = 0;
    blade_rng_seed(&a->rng, mix(seed ^ 0x61727269766c73ull));
}

/* (0, 1], so log never sees 0. */
static double open_uniform(blade_rng *r)
{
    return 1.0 - blade_rng_uniform(r);
}

static double standard_normal(blade_rng *r)
{
    double u1 = open_uniform(r), u2 = blade_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* Marsaglia and Tsang's method (2000) for shape >= 1; below 1, Gamma(k) = Gamma(k+1) x
 * U^(1/k). Unit scale. */
static double gamma_draw(blade_rng *r, double k)
{
    if (k < 1.0)
        return gamma_draw(r, k + 1.0) * pow(open_uniform(r), 1.0 / k);
    double d = k - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = standard_normal(r);
        double v = 1.0 + c * x;
        if (v <= 0)
            continue;
        v = v * v * v;
        double u = open_uniform(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v))
            return d * v;
    }
}

double lg_arrivals_next(lg_arrivals *a)
{
    double now = a->t;
    if (isfinite(a->rate) && a->rate > 0) {
        double gap = a->shape == 1.0 ? -log(open_uniform(&a->rng)) : gamma_draw(&a->rng, a->shape) / a->shape;
        a->t += gap / a->rate;
    }
    return now;
}
