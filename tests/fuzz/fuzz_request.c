/* libFuzzer target for OpenAI request bodies (README: build-fuzz/fuzz_request CORPUS from the
 * repository root, seeded by build-fuzz/fuzz_seeds). Every
 * HTTP body a server takes goes through api_parse_body: the first input byte picks the
 * endpoint (completions, chat, embeddings), the rest is the body, validated against
 * stories260K (or BLADE_FUZZ_MODEL) with a chat template that renders tools. A request is
 * only parsed, never run. Any crash, hang or sanitizer report is a bug: a hostile body must
 * end in a 400 naming what is wrong. */

#include "api/error.h"
#include "api/model.h"
#include "api/request.h"
#include "blade/engine.h"
#include "blade/model.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char chat_template[] =
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string %}{{ m['content'] }}"
    "{%- elif m['content'] %}{%- for p in m['content'] %}{{ p['text'] }}{%- endfor %}{%- endif %}"
    "{%- for c in m.get('tool_calls', []) %}{{ c['function']['name'] }}({{ c['function']['arguments'] | tojson }})"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

static api_model am;
static bool ready;
/* FUZZ_REQUEST_VERBOSE=1: say why each refused body was refused (to check seeds) */
static bool verbose;

static void init(void)
{
    const char *path = getenv("BLADE_FUZZ_MODEL") ? getenv("BLADE_FUZZ_MODEL") : "../shared/models/stories260K.gguf";
    char template_path[] = "/tmp/fuzz_request_template_XXXXXX";
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    int fd = m ? mkstemp(template_path) : -1;
    if (fd < 0 || write(fd, chat_template, sizeof chat_template - 1) != (ssize_t)(sizeof chat_template - 1)) {
        fprintf(stderr, "fuzz_request: %s: %s\n", path, m ? "cannot write the chat template" : err.msg);
        abort();
    }
    close(fd);
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.n_threads = 1;
    cfg.kv_mem_bytes = 4u << 20;
    blade_engine *e = blade_engine_new(m, &cfg, &err);
    if (!e || api_model_init(&am, e, path, "fuzz", template_path, &err)) {
        fprintf(stderr, "fuzz_request: %s\n", err.msg);
        abort();
    }
    unlink(template_path);
    verbose = getenv("FUZZ_REQUEST_VERBOSE") != NULL;
    ready = true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!ready)
        init();
    if (size < 1)
        return 0;
    static const api_endpoint endpoints[] = {API_COMPLETIONS, API_CHAT, API_EMBEDDINGS};
    api_request req;
    api_error aerr;
    memset(&aerr, 0, sizeof aerr);
    if (api_parse_body(&am, endpoints[data[0] % 3], (const char *)data + 1, size - 1, &req, &aerr) == 0)
        api_request_free(&req);
    else if (verbose)
        fprintf(stderr, "refused (%d, %s): %s\n", aerr.status, aerr.param, aerr.message);
    return 0;
}
