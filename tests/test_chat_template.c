/* Chat templates: every reference rendering in ../shared/chat-templates/cases.json byte for
 * byte, the Jinja language feature by feature (outputs checked against what Jinja2 itself
 * renders), hostile templates that must fail quickly with a clear error, concurrent renders
 * of one template, and the `blade template` subcommand. */
#include "testutil.h"

#include "blade/chat_template.h"
#include "blade/gguf.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* 2026-01-15 12:00 UTC: the date the shared references were rendered with. */
#define CASES_TIME 1768478400LL

/* ---- helpers ---- */

static json_t *parse_json(const char *text)
{
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    if (!j)
        fail_msg("bad test JSON (%s): %s", je.text, text);
    return j;
}

/* Renders src with the JSON object ctx (NULL: an empty one); returns the output or NULL
 * with the parse or render error in err. */
static char *render(const char *src, const char *ctx, blade_error *err)
{
    blade_template *t = blade_template_parse(src, strlen(src), err);
    if (!t)
        return NULL;
    blade_template_set_time(t, CASES_TIME);
    json_t *c = parse_json(ctx ? ctx : "{}");
    char *out = NULL;
    size_t len = 0;
    int rc = blade_template_render(t, c, &out, &len, err);
    json_decref(c);
    blade_template_free(t);
    if (rc) {
        assert_null(out);
        return NULL;
    }
    assert_int_equal(strlen(out), len);
    return out;
}

static void expect_ctx(const char *src, const char *ctx, const char *want)
{
    blade_error err = {{0}};
    char *out = render(src, ctx, &err);
    if (!out)
        fail_msg("template %s\nfailed: %s", src, err.msg);
    if (strcmp(out, want))
        fail_msg("template %s\nexpected [%s]\n     got [%s]", src, want, out);
    free(out);
}

static void expect(const char *src, const char *want) { expect_ctx(src, NULL, want); }

/* The error must mention `needle`. */
static void expect_error_ctx(const char *src, const char *ctx, const char *needle)
{
    blade_error err = {{0}};
    char *out = render(src, ctx, &err);
    if (out)
        fail_msg("template %s\nrendered [%s] instead of failing", src, out);
    if (!strstr(err.msg, needle))
        fail_msg("template %s\nerror [%s] does not mention [%s]", src, err.msg, needle);
}

static void expect_error(const char *src, const char *needle) { expect_error_ctx(src, NULL, needle); }

/* ---- conformance with the reference renderings ---- */

static void show_escaped(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            fputs("\\n", stderr);
        else if (c < 0x20)
            fprintf(stderr, "\\x%02x", c);
        else
            fputc(c, stderr);
    }
}

static void show_around(const char *label, const char *s, size_t len, size_t at)
{
    size_t from = at > 40 ? at - 40 : 0, to = at + 40 < len ? at + 40 : len;
    fprintf(stderr, "    %s ...", label);
    show_escaped(s + from, to - from);
    fprintf(stderr, "...\n");
}

static void test_conformance(void **state)
{
    (void)state;
    char *path = require_shared("chat-templates/cases.json");
    json_error_t je;
    json_t *cases = json_load_file(path, 0, &je);
    if (!cases)
        fail_msg("%s: %s", path, je.text);
    free(path);
    size_t n = json_array_size(cases), failed = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *c = json_array_get(cases, i);
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *conv = json_string_value(json_object_get(c, "conversation"));
        const char *src = json_string_value(json_object_get(c, "template"));
        const char *want = json_string_value(json_object_get(c, "expected"));
        bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
        blade_error err = {{0}};
        char *out = NULL;
        size_t len = 0;
        int rc = -1;
        blade_template *t = blade_template_parse(src, strlen(src), &err);
        if (t) {
            blade_template_set_time(t, CASES_TIME);
            rc = blade_template_render_chat(t, json_object_get(c, "messages"), gen,
                                            json_string_value(json_object_get(c, "bos_token")),
                                            json_string_value(json_object_get(c, "eos_token")), &out, &len, &err);
            blade_template_free(t);
        }
        if (!want) {
            if (rc == 0) {
                failed++;
                fprintf(stderr, "FAIL %s [%s, generation prompt %d]: rendered instead of raising \"%s\"\n", name,
                        conv, gen, json_string_value(json_object_get(c, "expected_error")));
            }
        } else if (rc) {
            failed++;
            fprintf(stderr, "FAIL %s [%s, generation prompt %d]: %s\n", name, conv, gen, err.msg);
        } else if (len != strlen(want) || memcmp(out, want, len)) {
            size_t wlen = strlen(want), at = 0;
            while (at < len && at < wlen && out[at] == want[at])
                at++;
            failed++;
            fprintf(stderr, "FAIL %s [%s, generation prompt %d]: first difference at byte %zu\n", name, conv, gen,
                    at);
            show_around("expected", want, wlen, at);
            show_around("     got", out, len, at);
        }
        free(out);
    }
    fprintf(stderr, "chat template conformance: %zu/%zu cases\n", n - failed, n);
    json_decref(cases);
    assert_true(n > 0);
    assert_int_equal(failed, 0);
}

/* ---- the language ---- */

static void test_whitespace_control(void **state)
{
    (void)state;
    /* trim_blocks eats the newline after a tag, lstrip_blocks the indentation before it */
    expect("{% if true %}\n  yes\n{% endif %}\n  {% if true %}\n  two\n  {% endif %}\nend", "  yes\n  two\nend");
    expect("   {%- if true -%}   a   {%- endif -%}   b", "ab");
    expect("{% for x in [1,2] %}\n    {{ x }}\n{% endfor %}", "    1\n    2\n");
    expect("x {{- ' y ' -}} z", "x y z");
    /* lstrip only when the tag starts its line; never before {{ */
    expect("a  {% if true %}b{% endif %}  \n  c", "a  b  \n  c");
    expect("a\n    {{ 'b' }}", "a\n    b");
    /* `+` turns both rules off for one tag */
    expect("{%+ if true %}  x{% endif %}", "  x");
    expect("  {%+ if true %}x{% endif %}", "  x");
    expect("{% if true +%}\nx{% endif %}", "\nx");
    /* comments follow the block rules */
    expect("{# c #}\na\n  {# indented #}\nb {#- strip -#}   c", "a\nbc");
    expect("{% raw %}{{ not evaluated }}{% endraw %}", "{{ not evaluated }}");
    expect("  {% raw %}\n  {{ x }}\n  {% endraw %}\ndone", "\n  {{ x }}\ndone");
    expect("{% raw -%}   a   {%- endraw %}", "a");
    /* one trailing newline of the source is dropped, \r\n reads as \n */
    expect("a\n", "a");
    expect("a\n\n", "a\n");
    expect("a\r\nb\rc", "a\nb\nc");
    /* braces that close a tag only outside brackets */
    expect("{{ {'a': {'b': 1}} }}", "{'a': {'b': 1}}");
    expect("text with } and { and %} and #} and }}", "text with } and { and %} and #} and }}");
}

static void test_values_and_operators(void **state)
{
    (void)state;
    expect("{{ none }}|{{ true }}|{{ 1.0 }}|{{ [1, 'a', none, true, {'k': \"it's\"}] }}|{{ (1,) }}|{{ () }}",
           "None|True|1.0|[1, 'a', None, True, {'k': \"it's\"}]|(1,)|()");
    /* floats as Python's repr */
    expect("{{ 1.5e10 }} {{ 1e16 }} {{ 1e100 }} {{ 0.1 + 0.2 }} {{ 1.5e-5 }} {{ 0.0001 }} {{ -0.0 }} {{ 1/3 }}",
           "15000000000.0 1e+16 1e+100 0.30000000000000004 1.5e-05 0.0001 -0.0 0.3333333333333333");
    expect("{{ 10/2 }} {{ 7//2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 10 % -3 }} {{ 2**10 }} {{ 2 ** -1 }} {{ -10.5 % 3 }}",
           "5.0 3 -4 2 -2 1024 0.5 1.5");
    expect("{{ 2 ** 3 ** 2 }} {{ 2 * 3 + 4 }} {{ 2 + 3 * 4 }} {{ (1 + 2) ~ 'x' }} {{ 1_000 }} {{ 0x10 }} {{ 0b101 }}",
           "64 10 14 3x 1000 16 5");
    expect("{{ 'a' ~ 1 ~ 1.5 ~ true ~ none ~ [1] }}{{ 'ab' * 2 }}{{ 2 * 'c' }}{{ [1] * 2 }}{{ [1] + [2] }}",
           "a11.5TrueNone[1]ababcc[1, 1][1, 2]");
    expect("{{ true + 1 }}{{ -true }}{{ not 1 }}{{ 1 and 2 }}{{ 0 and 2 }}{{ 0 or 'x' }}", "2-1False20x");
    expect("{{ 1 < 2 < 3 }}{{ 1 < 3 < 2 }}{{ 1 == 1.0 }}{{ (1, 2) == [1, 2] }}{{ {'a': 1} == {'a': 1} }}",
           "TrueFalseTrueFalseTrue");
    expect("{{ 'a' in 'cat' }}{{ 1 in [1, 2] }}{{ 'a' in {'a': 1} }}{{ 3 not in [1] }}{{ 'b' < 'a' }}",
           "TrueTrueTrueTrueFalse");
    expect("{{ 'yes' if 1 else 'no' }}|{{ 'x' if false }}|{{ 1 if 0 else 2 if 0 else 3 }}", "yes||3");
    /* strings: escapes, adjacent literals, code-point indexing and slicing */
    expect("{{ 'it\\'s' }} {{ \"a\" \"b\" }} {{ '\\x41\\u00e9\\U0001F600' }} {{ 'tab\\tnl\\\\n' }}",
           "it's ab A\xc3\xa9\xf0\x9f\x98\x80 tab\tnl\\n");
    expect("{{ 'h\xc3\xa9llo'[1] }} {{ 'h\xc3\xa9llo'[1:3] }} {{ 'h\xc3\xa9llo'[::-1] }} {{ 'h\xc3\xa9llo'|length }}",
           "\xc3\xa9 \xc3\xa9l oll\xc3\xa9h 5");
    expect("{{ [1,2,3][-1] }}{{ [1,2,3][::2] }}{{ [1,2,3][::-1] }}{{ [1,2,3][5:] }}{{ 'abc'[:-1] }}",
           "3[1, 3][3, 2, 1][]ab");
    expect_ctx("{{ messages[0].role }}:{{ messages[-1]['content'] }}:{{ messages[1:]|length }}",
               "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"u\"}]}",
               "system:u:1");
}

static void test_undefined(void **state)
{
    (void)state;
    /* falsy and empty, but any operation on it names what was missing */
    expect("[{{ x }}]{{ x is defined }}{{ x is undefined }}{{ x|length }}{{ x|default('d') }}{{ not x }}",
           "[]FalseTrue0dTrue");
    expect("{% for a in x %}never{% else %}empty{% endfor %}{{ x ~ 'a' }}{{ x == y }}", "emptyaTrue");
    expect("{% set d = {'a': 1} %}[{{ d.b }}][{{ none.foo }}][{{ 'abc'.foo }}][{{ [1][5] }}]", "[][][][]");
    expect_error("{{ x.y }}", "'x' is undefined");
    expect_error("{% set d = {'a': 1} %}{{ d.b.c }}", "'dict object' has no attribute 'b'");
    expect_error("{{ x + 1 }}", "'x' is undefined");
    expect_error("{{ x() }}", "'x' is undefined");
    expect_error("{{ x|tojson }}", "not JSON serializable");
}

static void test_loops(void **state)
{
    (void)state;
    expect("{% for x in [1,2,3,4] if x > 1 %}{{ loop.index }}/{{ loop.length }}{{ loop.first }}{{ loop.last }}"
           "{{ loop.previtem }}{{ loop.nextitem }}{{ loop.revindex }}{{ loop.index0 }};{% endfor %}",
           "1/3TrueFalse330;2/3FalseFalse2421;3/3FalseTrue312;");
    expect("{% for i in range(10) %}{% if i == 3 %}{% continue %}{% endif %}{% if i == 6 %}{% break %}{% endif %}"
           "{{ i }}{% endfor %}",
           "01245");
    expect("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"
           "{% for a, (b, c) in [(1, (2, 3))] %}{{ a }}{{ b }}{{ c }}{% endfor %}",
           "a=1;b=2;123");
    expect("{% for c in 'h\xc3\xa9y' %}{{ c }},{% endfor %}{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}",
           "h,\xc3\xa9,y,ab");
    expect("{% for x in 'ab' %}{{ loop.cycle('odd', 'even') }}{% endfor %}{% for x in [1,1,2] %}"
           "{{ loop.changed(x) }}{% endfor %}",
           "oddevenTrueFalseTrue");
    expect("{% for x in [1] %}{% for y in [2,3] %}{{ loop.index }}{{ x }}{{ y }}{% endfor %}{{ loop.length }}"
           "{% endfor %}",
           "1122131");
    /* each iteration starts from the enclosing scope; nothing leaks out of the loop */
    expect("{% for i in range(3) %}{% if i == 0 %}{% set x = 5 %}{% endif %}{{ x }},{% endfor %}", "5,,,");
    expect("{% set x = 1 %}{% for i in range(2) %}{{ x }}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}", "12121");
    expect("{% set x = 1 %}{% if true %}{% set x = 3 %}{% endif %}{{ x }}", "3");
    expect("{{ range(5)|list }}{{ range(1, 5)|list }}{{ range(10, 0, -3)|list }}{{ range(0)|list }}",
           "[0, 1, 2, 3, 4][1, 2, 3, 4][10, 7, 4, 1][]");
    expect_error("{% for a, b in [1] %}{% endfor %}", "not iterable");
    expect_error("{% for x in none %}{% endfor %}", "'NoneType' object is not iterable");
    expect_error("{% break %}", "outside of a loop");
}

static void test_set_namespace_macro(void **state)
{
    (void)state;
    expect("{% set ns = namespace(a=1, b='x') %}{% for i in range(3) %}{% set ns.a = ns.a + i %}{% endfor %}"
           "{{ ns.a }}{{ ns.b }} {{ ns }}",
           "4x <Namespace {'a': 4, 'b': 'x'}>");
    expect("{% set ns = namespace() %}{% set ns.index = 0 %}{% for m in [1, 2] %}{% set ns.index = ns.index + m %}"
           "{% endfor %}{{ ns.index }}",
           "3");
    expect("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 'x') %}{{ t }}{{ t[1] }}", "12(1, 'x')x");
    expect("{% set x %}  hello {{ 1 + 1 }}  {% endset %}[{{ x }}]{% set y | upper %}abc{% endset %}{{ y }}",
           "[  hello 2  ]ABC");
    expect("{% set ns = namespace() %}{% set ns.text %}t{% endset %}{{ ns.text }}", "t");
    expect("{% filter upper %}hello {{ 'world' }}{% endfilter %}", "HELLO WORLD");
    expect("{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", "3[]");
    expect("{% generation %}kept{% endgeneration %}", "kept");
    expect("{% macro m(a, b=2, c='z') %}[{{ a }}|{{ b }}|{{ c }}]{% endmacro %}{{ m(1) }}{{ m(1, 3) }}"
           "{{ m(1, c=5) }}{{ m() }}",
           "[1|2|z][1|3|z][1|2|5][|2|z]");
    expect("{% macro m(a) %}{{ caller(a * 2) }}{% endmacro %}{% call(x) m(4) %}got {{ x }}{% endcall %}", "got 8");
    expect("{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(5) }}", "54321");
    /* a macro sees the template's top-level names at call time, not the caller's locals */
    expect("{% macro m(a) %}[{{ a }}{{ y }}{{ z }}]{% endmacro %}{% set y = 1 %}{% for z in [5] %}{{ m(2) }}"
           "{% endfor %}{% set z = 9 %}{{ m(3) }}",
           "[21][319]");
    expect_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "takes not more than 1 argument");
    expect_error("{% macro m(a) %}{% endmacro %}{{ m(b=2) }}", "no keyword argument 'b'");
    expect_error("{% set x = 1 %}{% set x.a = 2 %}", "not a namespace");
}

static void test_filters(void **state)
{
    (void)state;
    expect("{{ 'Hello World'|lower }} {{ 'hello world'|upper }} {{ 'hello world-foo(bar'|title }} "
           "{{ \"they're\"|title }} {{ 'hELLO wORLD'|capitalize }}",
           "hello world HELLO WORLD Hello World-Foo(Bar They're Hello world");
    expect("[{{ '  x  '|trim }}][{{ 'xxhixx'|trim('x') }}][{{ '\xe3\x80\x80x\xc2\xa0'|trim }}]", "[x][hi][x]");
    expect("{{ [3,1,2]|sort }}{{ [3,1,2]|sort(reverse=true) }}{{ ['b','A','a','B']|sort }}"
           "{{ ['b','A','a','B']|sort(case_sensitive=true) }}",
           "[1, 2, 3][3, 2, 1]['A', 'a', 'b', 'B']['A', 'B', 'a', 'b']");
    expect("{{ [{'n':'b','v':2},{'n':'a','v':1}]|sort(attribute='n')|map(attribute='v')|list }}", "[1, 2]");
    expect("{{ [1,2,1,3]|unique|list }}{{ ['a','A','b']|unique|list }}{{ [1,5,3]|max }}{{ [1,5,3]|min }}"
           "{{ ['a','B']|max }}{{ [1,2.5]|sum }}{{ [{'a':1},{'a':2}]|sum(attribute='a') }}",
           "[1, 2, 3]['a', 'b']51B3.53");
    expect("{{ {'b':1,'a':2}|dictsort }}{{ {'b':1,'a':2}|dictsort(by='value') }}"
           "{{ {'b':1,'a':2}|dictsort(reverse=true) }}",
           "[('a', 2), ('b', 1)][('b', 1), ('a', 2)][('b', 1), ('a', 2)]");
    expect("{{ [{'a':1},{'a':2},{'b':3}]|selectattr('a')|list }}{{ [{'r':'u'},{'r':'a'}]|selectattr('r','equalto','u')"
           "|list }}{{ [{'r':'u'},{'r':'a'}]|rejectattr('r','equalto','u')|list }}",
           "[{'a': 1}, {'a': 2}][{'r': 'u'}][{'r': 'a'}]");
    expect("{{ [1,2,3,4]|select('odd')|list }}{{ [1,2,3,4]|reject('odd')|list }}{{ [1,0,2]|select|list }}"
           "{{ [1,2,3]|select('>', 1)|list }}",
           "[1, 3][2, 4][1, 2][2, 3]");
    expect("{{ [{'a':1},{'a':2}]|map(attribute='a')|join(',') }}{{ ['a','b']|map('upper')|list }}"
           "{{ [{'x': 1}, {}]|map(attribute='x', default=0)|list }}{{ [[1,2],[3,4]]|map(attribute='1')|list }}"
           "{{ ['a','b']|map('replace', 'a', 'z')|list }}",
           "1,2['A', 'B'][1, 0][2, 4]['z', 'b']");
    expect("{{ [1,2,3]|join }}|{{ [1,2,3]|join(', ') }}|{{ [{'a':1},{'a':2}]|join('-', attribute='a') }}",
           "123|1, 2, 3|1-2");
    expect("{{ 3|round }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 2.5|round(0, 'floor') }} "
           "{{ 2.1|round(0, 'ceil') }} {{ 1234.5|round(-2) }}",
           "3 2.0 4.0 2.67 2.0 3.0 1200.0");
    expect("{{ '42'|int }} {{ '4.5'|int }} {{ 'x'|int }} {{ ' 12 '|int }} {{ '0x1A'|int(0, 16) }} {{ 'x'|int(7) }} "
           "{{ 1.9|int }} {{ '3'|float }} {{ 'x'|float(1.5) }} {{ 2|float }}",
           "42 4 0 12 26 7 1 3.0 1.5 2.0");
    expect("{{ \"line1\\nline2\"|indent(2) }}|{{ \"a\\n\\nb\"|indent(2, true) }}|{{ \"a\\n\\nb\"|indent(2, blank=true) }}"
           "|{{ \"a\\nb\\n\"|indent }}|{{ \"a\\nb\"|indent('> ') }}",
           "line1\n  line2|  a\n\n  b|a\n  \n  b|a\n    b\n|a\n> b");
    expect("{{ -3|abs }}{{ [1,2,3]|first }}{{ [1,2,3]|last }}{{ 'abc'|first }}{{ 'abc'|last }}[{{ []|first }}]"
           "{{ 'abc'|list }}{{ {'a':1}|list }}{{ 'abc'|reverse }}{{ [1,2]|reverse|list }}",
           "313ac[]['a', 'b', 'c']['a']cba[2, 1]");
    expect("{{ [1,2,3,4,5]|batch(2)|list }}{{ [1,2,3]|batch(2, 'x')|list }}{{ 'hello world foo'|wordcount }}"
           "[{{ 'abc'|center(9) }}]{{ '<a href=\"x\">&\\''|e }}",
           "[[1, 2], [3, 4], [5]][[1, 2], [3, 'x']]3[   abc   ]&lt;a href=&#34;x&#34;&gt;&amp;&#39;");
    expect("{{ 'x'|default('y') }}{{ undef|default('y') }}[{{ ''|default('y') }}]{{ ''|default('y', true) }}"
           "{{ undef|d('z') }}",
           "xy[]yz");
    expect("{{ 42|string|length }}{{ 3.0|string }}{{ [1]|string }}{{ 'x'|safe }}{{ {'a': 1}|items|list }}"
           "{{ undef|items|list }}",
           "23.0[1]x[('a', 1)][]");
    expect("{{ 'A%sB'|format('x') }}|{{ '%5.2f%%'|format(3.14159) }}|{{ '%-5d|'|format(42) }}|{{ '%+d'|format(5) }}|"
           "{{ '%#x %#o %X'|format(255, 8, 255) }}|{{ '%e'|format(12345.678) }}|{{ '%g'|format(0.00001) }}|"
           "{{ '%c'|format(65) }}|{{ '%05d'|format(-42) }}|{{ '%.3s'|format('abcdef') }}",
           "AxB| 3.14%|42   ||+5|0xff 0o10 FF|1.234568e+04|1e-05|A|-0042|abc");
    expect("{{ '%(x)s-%(y)d' % {'x': 'a', 'y': 2} }}|{{ '%s' % [1, 2] }}|{{ '%s' % (1,) }}|{{ '%s and %d' % ('a', 3) }}"
           "|{{ '%r' % 'q' }}",
           "a-2|[1, 2]|1|a and 3|'q'");
    expect("{{ '\\u00e9cole'|upper }} {{ '\\u00c9COLE'|lower }} {{ 'stra\\u00dfe'|upper }} {{ '\\u0391\\u0392\\u0393'|lower }}"
           " {{ '\\u043f\\u0440\\u0438\\u0432\\u0435\\u0442'|upper }}",
           "\xc3\x89"
           "COLE \xc3\xa9"
           "cole STRASSE \xce\xb1\xce\xb2\xce\xb3 \xd0\x9f\xd0\xa0\xd0\x98\xd0\x92\xd0\x95\xd0\xa2");
    expect_error("{{ [1,'a']|sort }}", "'<' not supported between instances of 'str' and 'int'");
    expect_error("{{ 'abc' % 5 }}", "not all arguments converted");
    expect_error("{{ 1 / 0 }}", "division by zero");
}

static void test_tojson(void **state)
{
    (void)state;
    /* Python's json.dumps as Hugging Face calls it: non-ASCII kept, ", " and ": " */
    expect("{{ {'a':[1,2,\"\\u00e9\"],'b':none, 'c': 1.5, 'd': true} | tojson }}",
           "{\"a\": [1, 2, \"\xc3\xa9\"], \"b\": null, \"c\": 1.5, \"d\": true}");
    expect("{{ {'a':[1,2], 'b': {}, 'c': []} | tojson(indent=2) }}",
           "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {},\n  \"c\": []\n}");
    expect("{{ \"a\\\"b\\\\c\\n\\u0001\"|tojson }}{{ ['\\u00e9', '\\U0001F600']|tojson(ensure_ascii=true) }}"
           "{{ {'z':1,'a':2}|tojson(sort_keys=true) }}{{ [1,2]|tojson(separators=(',',':')) }}",
           "\"a\\\"b\\\\c\\n\\u0001\"[\"\\u00e9\", \"\\ud83d\\ude00\"]{\"a\": 2, \"z\": 1}[1,2]");
    expect("{{ {1: 'a', true: 'b', none: 'c'}|tojson }}{{ [1.0, 1e100, -0.0]|tojson }}"
           "{{ {'a':[1,{'b':2}]}|tojson(indent='\\t') }}",
           "{\"1\": \"b\", \"null\": \"c\"}[1.0, 1e+100, -0.0]{\n\t\"a\": [\n\t\t1,\n\t\t{\n\t\t\t\"b\": 2\n\t\t}\n\t]\n}");
    /* key order is the document's */
    expect_ctx("{{ tool|tojson }}", "{\"tool\": {\"z\": 1, \"a\": {\"y\": [true, null]}, \"m\": \"\xe2\x80\x94\"}}",
               "{\"z\": 1, \"a\": {\"y\": [true, null]}, \"m\": \"\xe2\x80\x94\"}");
    expect_error("{{ namespace()|tojson }}", "not JSON serializable");
}

static void test_tests_and_methods(void **state)
{
    (void)state;
    expect("{{ 5 is divisibleby 5 }}{{ 'x' is string }}{{ [1] is iterable }}{{ {} is sequence }}{{ 1 is number }}"
           "{{ true is number }}{{ none is none }}{{ 3 is odd }}{{ 4 is even }}{{ 1 is integer }}{{ true is integer }}"
           "{{ 1.0 is float }}{{ {} is mapping }}{{ 1 is eq 1 }}{{ 2 is gt 1 }}{{ 'a' is in 'abc' }}{{ true is true }}"
           "{{ false is false }}{{ true is boolean }}{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ 1 is not string }}"
           "{{ 'upper' is filter }}{{ 'odd' is test }}",
           "TrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrue");
    expect("{% if x is not defined %}a{% endif %}{% if not x is defined %}b{% endif %}{{ raise_exception is defined }}"
           "{{ strftime_now is defined }}{{ range is callable }}",
           "abTrueTrueTrue");
    expect("{{ 'a,b,,c'.split(',') }}{{ ' a  b c '.split() }}{{ 'a b c'.split(None, 1) }}{{ 'a,b,c'.rsplit(',', 1) }}"
           "{{ ' a  b  c '.rsplit(None, 1) }}{{ 'a\\nb\\r\\nc'.splitlines() }}{{ ''.split(',') }}{{ ''.split() }}",
           "['a', 'b', '', 'c']['a', 'b', 'c']['a', 'b c']['a,b', 'c'][' a  b', 'c']['a', 'b', 'c'][''][]");
    expect("[{{ '  x '.strip() }}][{{ '  x '.lstrip() }}][{{ '  x '.rstrip() }}][{{ 'xyhixy'.strip('xy') }}]",
           "[x][x ][  x][hi]");
    expect("{{ 'hello'.startswith('he') }}{{ 'hello'.endswith('lo') }}{{ 'hello'.startswith(('x','h')) }}"
           "{{ 'hello'.replace('l','L') }}{{ 'hello'.replace('l','L',1) }}{{ 'ab'.replace('','-') }}",
           "TrueTrueTrueheLLoheLlo-a-b-");
    expect("{{ 'hello world'.title() }} {{ \"they're bill's\".title() }} {{ 'HeLLo'.upper() }} {{ 'HeLLo'.lower() }} "
           "{{ 'hello'.capitalize() }} {{ 'Hello'.swapcase() }}",
           "Hello World They'Re Bill'S HELLO hello Hello hELLO");
    expect("{{ 'hello'.find('l') }}{{ 'hello'.rfind('l') }}{{ 'hello'.count('l') }}{{ 'aaa'.count('aa') }}"
           "{{ 'h\\u00e9llo'.find('l') }}{{ 'abc'.find('z') }}",
           "23212-1");
    expect("{{ '-'.join(['a','b']) }}{{ '{} and {}'.format(1, 'x') }}{{ '{0}{name}'.format('a', name='b') }}"
           "{{ '1'.isdigit() }}{{ 'a1'.isalnum() }}{{ ' '.isspace() }}{{ 'ab'.islower() }}",
           "a-b1 and xabTrueTrueTrueTrue");
    expect("{% set d = {'a': 1, 'b': [1,2]} %}{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 5) }}{{ d.keys()|list }}"
           "{{ d.values()|list }}{{ d.items()|list }}",
           "1None5['a', 'b'][1, [1, 2]][('a', 1), ('b', [1, 2])]");
    /* the DeepSeek-R1 idiom */
    expect("{% set c = 'a</think>b</think>answer' %}{% if '</think>' in c %}{{ c.split('</think>')[-1] }}{% endif %}",
           "answer");
    expect("{{ strftime_now('%d %b %Y') }}", "15 Jan 2026");
    expect_error("{{ {}.update({}) }}", "has no attribute 'update'");
    expect_error("{{ 'abc'() }}", "'str' object is not callable");
}

static void test_errors(void **state)
{
    (void)state;
    /* raise_exception's message is passed through as written */
    blade_error err = {{0}};
    assert_null(render("{{ raise_exception('Roles must alternate') }}", NULL, &err));
    assert_string_equal(err.msg, "Roles must alternate");
    /* syntax errors name the line */
    assert_null(render("line one\n{% if x %}\n{% endfor %}", NULL, &err));
    assert_non_null(strstr(err.msg, "line 3"));
    expect_error("{% if x %}open", "never closed by '{% endif %}'");
    expect_error("{% for x in y %}open", "never closed by '{% endfor %}'");
    expect_error("{{ x ", "never closed");
    expect_error("{# never", "unterminated comment");
    expect_error("{% raw %} never", "never closed by {% endraw %}");
    expect_error("{{ 'never }}", "unterminated string");
    expect_error("{% include 'x' %}", "unknown tag 'include'");
    expect_error("{{ x|nosuchfilter }}", "no filter named 'nosuchfilter'");
    expect_error("{{ x is nosuchtest }}", "no test named 'nosuchtest'");
    expect_error("{{ (1 }}", "unexpected");
    expect_error("{{ 1 + }}", "unexpected");
    expect_error("{{ 'x' + 1 }}", "can only concatenate str (not \"int\") to str");
    expect_error("{{ 2 ** 100 }}", "too large");
    /* the context must be an object */
    blade_template *t = blade_template_parse("x", 1, &err);
    assert_non_null(t);
    json_t *arr = json_array();
    char *out = NULL;
    assert_int_equal(blade_template_render(t, arr, &out, NULL, &err), -1);
    assert_null(out);
    json_decref(arr);
    blade_template_free(t);
}

/* ---- hostile templates ---- */

static char *repeat_str(const char *s, size_t n)
{
    size_t len = strlen(s);
    char *out = malloc(len * n + 1);
    assert_non_null(out);
    for (size_t i = 0; i < n; i++)
        memcpy(out + i * len, s, len);
    out[len * n] = 0;
    return out;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Each must fail with its limit's error well within the time a request can wait. */
static void expect_refused(const char *what, const char *src, const char *needle)
{
    double t0 = now_s();
    blade_error err = {{0}};
    char *out = render(src, NULL, &err);
    double dt = now_s() - t0;
    if (out)
        fail_msg("%s: rendered %zu bytes instead of failing", what, strlen(out));
    if (!strstr(err.msg, needle))
        fail_msg("%s: error [%s] does not mention [%s]", what, err.msg, needle);
    if (dt > 20.0)
        fail_msg("%s: took %.1f s to fail", what, dt);
}

static void test_hostile(void **state)
{
    (void)state;
    char *open_ifs = repeat_str("{% if true %}", 10000), *close_ifs = repeat_str("{% endif %}", 10000);
    char *ifs = malloc(strlen(open_ifs) + strlen(close_ifs) + 2);
    sprintf(ifs, "%sx%s", open_ifs, close_ifs);
    expect_refused("10000 nested ifs", ifs, "nested too deeply");
    free(open_ifs);
    free(close_ifs);
    free(ifs);

    char *parens = repeat_str("(", 100000), *deep = malloc(100000 + 16);
    sprintf(deep, "{{ %s1 }}", parens);
    expect_refused("100000 open parentheses", deep, "nested too deeply");
    free(parens);
    free(deep);

    char *chain = repeat_str(".b", 100000), *attrs = malloc(200000 + 16);
    sprintf(attrs, "{{ a%s }}", chain);
    expect_refused("attribute chain", attrs, "nested too deeply");
    free(chain);
    free(attrs);

    char *nots = repeat_str("not ", 100000), *notexpr = malloc(400000 + 16);
    sprintf(notexpr, "{{ %s1 }}", nots);
    expect_refused("100000 nots", notexpr, "nested too deeply");
    free(nots);
    free(notexpr);

    expect_refused("range(10**9)", "{% for i in range(10**9) %}x{% endfor %}", "range too big");
    expect_refused("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                   "work budget");
    expect_refused("loop with output", "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
                   "work budget");
    expect_refused("huge string multiplication", "{{ 'a' * 1000000000 }}", "limit");
    expect_refused("huge list multiplication", "{{ ([1] * 1000000000)|length }}", "memory budget");
    expect_refused("doubling string",
                   "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                   "limit");
    expect_refused("output over the limit", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "limit");
    expect_refused("memory", "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                             "{% set ns.l = ns.l + ['x' * 1000000 ~ i] %}{% endfor %}",
                   "memory budget");
    expect_refused("macro recursion", "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "macro calls nested");
    expect_refused("binary macro recursion",
                   "{% macro m(n) %}{% if n < 40 %}{{ m(n + 1) }}{{ m(n + 1) }}{% endif %}{% endmacro %}{{ m(0) }}",
                   "work budget");
    expect_refused("deeply nested value",
                   "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}"
                   "{{ ns.l }}",
                   "nested more than");
    expect_refused("quadratic scans", "{% set l = range(100000)|list %}{% for i in range(100000) %}"
                                      "{% if -1 in l %}{% endif %}{% endfor %}",
                   "work budget");
    expect_refused("strip with a long set", "{% set s = 'a' * 1000000 %}{% set c = 'b' * 100000 ~ 'a' %}"
                                            "{% for i in range(100000) %}{% set x = s.strip(c) %}{% endfor %}",
                   "work budget");
    expect_refused("slicing long text", "{% set s = '\xc3\xa9' * 1000000 %}{% for i in range(100000) %}"
                                        "{% set x = s[500000:] %}{% endfor %}",
                   "work budget");
    /* freeing deep or cyclic values must neither recurse without bound nor leak */
    expect("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}ok", "ok");
    expect("{% set ns = namespace(n=none) %}{% for i in range(50000) %}{% set ns = namespace(n=ns) %}{% endfor %}ok",
           "ok");
    expect("{% set ns = namespace() %}{% set ns.self = ns %}{% set ns.l = [ns, {'k': ns}] %}ok", "ok");
    expect("{% macro m() %}{{ caller() }}{% endmacro %}{% set ns = namespace() %}"
           "{% call m() %}{% set ns.c = caller %}{% endcall %}ok",
           "ok");
    expect_error("{% macro m() %}{{ caller }}{% endmacro %}{% set ns = namespace(c=none) %}"
                 "{% macro keep() %}{% set ns.c = caller %}{% endmacro %}"
                 "{% call keep() %}x{% endcall %}{{ ns.c() }}",
                 "caller() used after its call block");
}

/* ---- one template, several threads ---- */

static const char thread_src[] =
    "{%- set ns = namespace(n=0) -%}{%- macro turn(m) -%}<|{{ m.role }}|>{{ m.content|trim }}{%- endmacro -%}"
    "{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}{{ turn(m) }}{{ '\\n' if not loop.last }}{%- endfor -%}"
    "{{ ' ' ~ ns.n ~ ' ' ~ messages|tojson }}";

typedef struct thread_job {
    const blade_template *t;
    json_t *messages;
    const char *want;
    int mismatches;
} thread_job;

static void *render_many(void *arg)
{
    thread_job *job = arg;
    for (int i = 0; i < 200; i++) {
        char *out = NULL;
        blade_error err = {{0}};
        if (blade_template_render_chat(job->t, job->messages, false, "", "", &out, NULL, &err) ||
            strcmp(out, job->want))
            job->mismatches++;
        free(out);
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    blade_error err = {{0}};
    blade_template *t = blade_template_parse(thread_src, strlen(thread_src), &err);
    assert_non_null(t);
    json_t *messages = parse_json("[{\"role\": \"user\", \"content\": \" hi \"}, {\"role\": \"assistant\", "
                                  "\"content\": \"\xe2\x9c\x93 yes\"}]");
    const char *want = "<|user|>hi\n<|assistant|>\xe2\x9c\x93 yes 2 [{\"role\": \"user\", \"content\": \" hi \"}, "
                       "{\"role\": \"assistant\", \"content\": \"\xe2\x9c\x93 yes\"}]";
    thread_job jobs[4];
    pthread_t tids[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (thread_job){t, messages, want, 0};
        assert_int_equal(pthread_create(&tids[i], NULL, render_many, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(tids[i], NULL);
        assert_int_equal(jobs[i].mismatches, 0);
    }
    json_decref(messages);
    blade_template_free(t);
}

/* ---- blade template ---- */

static char *write_temp(const char *name, const char *text)
{
    char *path = temp_path(name);
    assert_int_equal(write_file(path, text, strlen(text)), 0);
    return path;
}

static void test_cli(void **state)
{
    (void)state;
    char *tpl = write_temp("chat_tpl.jinja", "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                                             "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                                             "{% endif %}");
    char *msgs = write_temp("chat_msgs.json", "[{\"role\": \"user\", \"content\": \"Hi \xe2\x9c\x93\"}]");
    char *bad = write_temp("chat_bad.jinja", "{{ raise_exception('System role not supported') }}");
    char *ctx = write_temp("chat_ctx.json",
                           "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"name\": \"f\"}]}");
    char *tools_tpl = write_temp("chat_tools.jinja", "{{ tools|tojson }}|{{ messages[0].content }}");
    char args[2048], *out = NULL;

    snprintf(args, sizeof args, "template --template '%s' --messages '%s' --bos-token '<s>' --eos-token '</s>' "
                                "--add-generation-prompt", tpl, msgs);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_string_equal(out, "<s><|user|>Hi \xe2\x9c\x93</s><|assistant|>");
    free(out);

    snprintf(args, sizeof args, "template --template '%s' --messages '%s'", tpl, msgs);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_string_equal(out, "<|user|>Hi \xe2\x9c\x93");
    free(out);

    /* an object is the whole context */
    snprintf(args, sizeof args, "template --template '%s' --messages '%s'", tools_tpl, ctx);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_string_equal(out, "[{\"name\": \"f\"}]|x");
    free(out);

    snprintf(args, sizeof args, "template --template '%s' --messages '%s'", bad, msgs);
    assert_int_equal(run_blade(args, &out, 1), 1);
    assert_non_null(strstr(out, "System role not supported"));
    free(out);

    assert_int_equal(run_blade("template --help", &out, 0), 0);
    for (const char *const *flag = (const char *const[]){"--model", "--template", "--messages",
                                                           "--add-generation-prompt", "--bos-token", "--eos-token",
                                                           "--help", NULL};
         *flag; flag++)
        if (!strstr(out, *flag))
            fail_msg("--help does not describe %s", *flag);
    free(out);

    snprintf(args, sizeof args, "template --template '%s'", tpl);
    assert_int_equal(run_blade(args, NULL, 0), 2);
    snprintf(args, sizeof args, "template --template '%s' --messages '%s.missing'", tpl, msgs);
    assert_int_equal(run_blade(args, NULL, 0), 1);

    /* -m: the template and the BOS/EOS texts come from the GGUF */
    char *model = temp_path("chat_model.gguf"), *bare = temp_path("chat_bare.gguf");
    const char *tokens[] = {"<unk>", "<s>", "</s>", ("\xe2\x96\x81" "a")};
    const float scores[] = {0, 0, 0, -1};
    const int32_t types[] = {2, 3, 3, 1};
    blade_error err = {{0}};
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_string(w, "general.architecture", "llama");
    gguf_writer_set_string(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_string_array(w, "tokenizer.ggml.tokens", tokens, 4);
    gguf_writer_set_array(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores, 4);
    gguf_writer_set_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, 4);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    gguf_writer_set_string(w, "tokenizer.chat_template",
                           "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}{{ eos_token }}");
    if (gguf_writer_write(w, model, false, &err))
        fail_msg("writing %s: %s", model, err.msg);
    gguf_writer_free(w);
    w = gguf_writer_new();
    gguf_writer_set_string(w, "general.architecture", "llama");
    if (gguf_writer_write(w, bare, false, &err))
        fail_msg("writing %s: %s", bare, err.msg);
    gguf_writer_free(w);

    snprintf(args, sizeof args, "template -m '%s' --messages '%s'", model, msgs);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_string_equal(out, "<s>[Hi \xe2\x9c\x93]</s>");
    free(out);
    snprintf(args, sizeof args, "template -m '%s' --messages '%s' --eos-token END", model, msgs);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_string_equal(out, "<s>[Hi \xe2\x9c\x93]END");
    free(out);
    snprintf(args, sizeof args, "template -m '%s' --messages '%s'", bare, msgs);
    assert_int_equal(run_blade(args, &out, 1), 1);
    assert_non_null(strstr(out, "no tokenizer.chat_template"));
    free(out);

    free(model);
    free(bare);
    free(tpl);
    free(msgs);
    free(bad);
    free(ctx);
    free(tools_tpl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conformance),
        cmocka_unit_test(test_whitespace_control),
        cmocka_unit_test(test_values_and_operators),
        cmocka_unit_test(test_undefined),
        cmocka_unit_test(test_loops),
        cmocka_unit_test(test_set_namespace_macro),
        cmocka_unit_test(test_filters),
        cmocka_unit_test(test_tojson),
        cmocka_unit_test(test_tests_and_methods),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_hostile),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
