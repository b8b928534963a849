/* libFuzzer target for chat templates (README: build-fuzz/fuzz_template CORPUS, seeded by
 * build-fuzz/fuzz_seeds). A template comes from a GGUF
 * file or --chat-template, so its source is hostile: the input is parsed and, when it
 * parses, rendered against a conversation with tools and a tool call, as a server does.
 * Rendering is bounded in time and output; a crash, hang or sanitizer report is a bug. */

#include "blade/chat_template.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>

static json_t *messages;

static void init(void)
{
    messages = json_loads("[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                          "{\"role\":\"user\",\"content\":\"Hi <b>\\u00e9\\n\"},"
                          "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
                          "\"function\":{\"name\":\"f\",\"arguments\":{\"x\":[1,2.5,true,null]}}}]},"
                          "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"42\"},"
                          "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"and?\"}]}]",
                          0, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!messages)
        init();
    blade_template *t = blade_template_parse((const char *)data, size, NULL);
    if (!t)
        return 0;
    blade_template_set_time(t, 1700000000);
    char *out = NULL;
    size_t len = 0;
    if (blade_template_render_chat(t, messages, true, "<s>", "</s>", &out, &len, NULL) == 0)
        free(out);
    blade_template_free(t);
    return 0;
}
