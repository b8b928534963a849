/* Parsing argv and writing --help from a command's flag tables (flags.h). */

#include "cli/flags.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* The help is wrapped to this width, its text starting at most this far in. */
#define HELP_WIDTH 100
#define HELP_COLUMN_MAX 32
/* Flags one command may have, its tables together (for the required-flag check). */
#define MAX_FLAGS 256
/* What the parsing steps return after printing the help: the command ends with status 0. */
#define HELP_SHOWN (-2)

typedef struct found {
    const cli_flag *flag;
    size_t base;
    int index; /* across the command's tables */
} found;

static bool is_flag(const cli_flag *f)
{
    return f->kind != CLI_HEADING;
}

bool cli_flag_takes_value(const cli_flag *f)
{
    return f->kind != CLI_BOOL;
}

bool cli_choice_get(const cli_flag *f, int i, cli_choice *out)
{
    if (f->choice_at)
        return f->choice_at(i, out);
    if (!f->choices || !f->choices[i].name)
        return false;
    *out = f->choices[i];
    return true;
}

/* The first flag of the command that matches key. */
static bool find_flag(const cli_command *cmd, bool (*match)(const cli_flag *, const void *), const void *key,
                      found *out)
{
    int index = 0;
    for (const cli_table *t = cmd->tables; t && t->flags; t++)
        for (const cli_flag *f = t->flags; f->kind != CLI_END; f++) {
            if (!is_flag(f))
                continue;
            if (match(f, key)) {
                *out = (found){f, t->base, index};
                return true;
            }
            index++;
        }
    return false;
}

typedef struct name_key {
    const char *s;
    size_t len;
} name_key;

static bool match_name(const cli_flag *f, const void *key)
{
    const name_key *k = key;
    return strlen(f->name) == k->len && !strncmp(f->name, k->s, k->len);
}

static bool match_letter(const cli_flag *f, const void *key)
{
    return f->letter && f->letter == *(const char *)key;
}

/* ---- values ---- */

bool cli_int_in(const char *s, long long min, long long max, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < min || v > max)
        return false;
    *out = v;
    return true;
}

/* The double bounds of an integer flag as integers (INT64_MAX does not survive a double). */
static long long int_bound(double d)
{
    if (d >= 0x1p63)
        return INT64_MAX;
    if (d <= -0x1p63)
        return INT64_MIN;
    return (long long)d;
}

static void write_int(void *dest, const cli_flag *f, long long v)
{
    if (f->ctype == CLI_C_BOOL) {
        *(bool *)dest = v != 0;
        return;
    }
    switch (f->size) {
    case 1: *(int8_t *)dest = (int8_t)v; break;
    case 2: *(int16_t *)dest = (int16_t)v; break;
    case 4: *(int32_t *)dest = (int32_t)v; break;
    default: *(int64_t *)dest = (int64_t)v; break;
    }
}

static long long read_int(const void *src, const cli_flag *f)
{
    if (f->ctype == CLI_C_BOOL)
        return *(const bool *)src;
    bool u = f->ctype == CLI_C_UNSIGNED;
    switch (f->size) {
    case 1: return u ? *(const uint8_t *)src : *(const int8_t *)src;
    case 2: return u ? *(const uint16_t *)src : *(const int16_t *)src;
    case 4: return u ? (long long)*(const uint32_t *)src : *(const int32_t *)src;
    default: return *(const int64_t *)src;
    }
}

static const double size_units[] = {1.0, 1024.0, 1048576.0, 1073741824.0, 1099511627776.0, 1125899906842624.0};
static const char size_letters[] = " KMGTP";

/* "8M", "1.5G", "4096", "2GiB" -> bytes; *plain: no unit was given. */
static bool parse_bytes(const char *s, double *bytes, bool *plain)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v <= 0 || !isdigit((unsigned char)*s))
        return false;
    *plain = *end == 0;
    double unit = 1;
    if (*end) {
        const char *u = strchr(size_letters + 1, toupper((unsigned char)*end));
        if (!u)
            return false;
        unit = size_units[u - size_letters];
        end++;
        if (*end && strcasecmp(end, "B") && strcasecmp(end, "iB"))
            return false;
    }
    *bytes = v * unit;
    return true;
}

/* 8388608 -> "8M": the largest unit that divides it. */
static void format_bytes(char *buf, size_t cap, double bytes)
{
    int u = 5;
    while (u > 0 && fmod(bytes, size_units[u]) != 0)
        u--;
    if (u)
        snprintf(buf, cap, "%.0f%c", bytes / size_units[u], size_letters[u]);
    else
        snprintf(buf, cap, "%.0f", bytes);
}

/* "a, b or c" (sep ", ", last_sep " or "), "a|b|c" */
static void format_choices(char *buf, size_t cap, const cli_flag *f, const char *sep, const char *last_sep)
{
    cli_choice c;
    int n = 0;
    while (cli_choice_get(f, n, &c))
        n++;
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < n && len < cap; i++) {
        cli_choice_get(f, i, &c);
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", i == 0 ? "" : i == n - 1 ? last_sep : sep, c.name);
    }
}

/* The range part of an error message: "an integer in [1, 1024]". */
static void describe_expected(char *buf, size_t cap, const cli_flag *f)
{
    char lo[32], hi[32], list[512];
    switch (f->kind) {
    case CLI_INT: snprintf(buf, cap, "an integer in [%lld, %lld]", int_bound(f->min), int_bound(f->max)); break;
    case CLI_DOUBLE: snprintf(buf, cap, "a number in [%g, %g]", f->min, f->max); break;
    case CLI_SIZE:
    case CLI_SIZE_OR_FRACTION:
        format_bytes(lo, sizeof lo, f->min);
        format_bytes(hi, sizeof hi, f->max);
        snprintf(buf, cap, "a size from %s to %s bytes (e.g. 512M or 2G)%s", lo, hi,
                 f->kind == CLI_SIZE_OR_FRACTION ? " or a fraction in (0, 1)" : "");
        break;
    case CLI_ENUM:
        format_choices(list, sizeof list, f, ", ", " or ");
        snprintf(buf, cap, "%s", list);
        break;
    default: snprintf(buf, cap, "a value"); break;
    }
}

/* Stores one value; false with *why set on a bad one. */
static bool store(const cli_flag *f, void *dest, const char *value, char *why, size_t cap)
{
    char expected[600];
    long long n;
    switch (f->kind) {
    case CLI_BOOL: *(bool *)dest = !f->negate; return true;
    case CLI_INT:
        if (!cli_int_in(value, int_bound(f->min), int_bound(f->max), &n))
            break;
        write_int(dest, f, n);
        return true;
    case CLI_DOUBLE: {
        char *end;
        errno = 0;
        double v = strtod(value, &end);
        bool inf_ok = isinf(f->max) && f->max > 0;
        if (errno || end == value || *end || isnan(v) || (isinf(v) && !(inf_ok && v > 0)) || v < f->min ||
            v > f->max)
            break;
        if (f->ctype == CLI_C_FLOAT)
            *(float *)dest = (float)v;
        else
            *(double *)dest = v;
        return true;
    }
    case CLI_SIZE:
    case CLI_SIZE_OR_FRACTION: {
        double bytes;
        bool plain;
        if (!parse_bytes(value, &bytes, &plain))
            break;
        if (f->kind == CLI_SIZE_OR_FRACTION && plain && bytes < 1) {
            *(cli_size *)dest = (cli_size){.bytes = 0, .fraction = bytes};
            return true;
        }
        if (bytes < f->min || bytes > f->max)
            break;
        if (f->kind == CLI_SIZE)
            *(size_t *)dest = (size_t)bytes;
        else
            *(cli_size *)dest = (cli_size){.bytes = (size_t)bytes, .fraction = 0};
        return true;
    }
    case CLI_STRING:
    case CLI_PATH:
        if (!*value && !f->empty_ok) {
            snprintf(why, cap, "--%s is empty", f->name);
            return false;
        }
        *(const char **)dest = value;
        return true;
    case CLI_ENUM: {
        cli_choice c;
        for (int i = 0; cli_choice_get(f, i, &c); i++)
            if (!strcasecmp(c.name, value)) {
                write_int(dest, f, c.value);
                return true;
            }
        break;
    }
    case CLI_LIST: {
        cli_list *l = dest;
        if (l->n == CLI_LIST_MAX) {
            snprintf(why, cap, "--%s is given more than %d times", f->name, CLI_LIST_MAX);
            return false;
        }
        l->items[l->n++] = value;
        return true;
    }
    case CLI_CUSTOM: return f->parse(f, value, dest, why, cap);
    default: break;
    }
    describe_expected(expected, sizeof expected, f);
    snprintf(why, cap, "--%s expects %s, got '%s'", f->name, expected, value);
    return false;
}

/* ---- errors ---- */

static int usage_error_v(const cli_command *cmd, FILE *err, const char *fmt, va_list ap)
{
    fprintf(err, "error: ");
    vfprintf(err, fmt, ap);
    fprintf(err, "\nusage: blade %s %s  (--help describes every flag)\n", cmd->name, cmd->synopsis);
    return 2;
}

static int usage_error(const cli_command *cmd, FILE *err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int usage_error(const cli_command *cmd, FILE *err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = usage_error_v(cmd, err, fmt, ap);
    va_end(ap);
    return rc;
}

int cli_usage_error(const cli_command *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = usage_error_v(cmd, stderr, fmt, ap);
    va_end(ap);
    return rc;
}

/* ---- parsing ---- */

typedef struct parse_state {
    const cli_command *cmd;
    void *opts;
    FILE *out, *err;
    bool given[MAX_FLAGS];
} parse_state;

/* 0 when stored, else the exit status. */
static int apply(parse_state *ps, const found *fd, const char *value)
{
    const cli_flag *f = fd->flag;
    char why[1024];
    void *dest = (char *)ps->opts + fd->base + f->off;
    if (!store(f, dest, value, why, sizeof why))
        return usage_error(ps->cmd, ps->err, "%s", why);
    if (fd->index < MAX_FLAGS)
        ps->given[fd->index] = true;
    if (ps->cmd->observe && !ps->cmd->observe(ps->opts, f, value, ps->err))
        return 2;
    return 0;
}

static int count_positionals(const cli_command *cmd)
{
    int n = 0;
    while (cmd->positionals && cmd->positionals[n].metavar)
        n++;
    return n;
}

/* Checks what must be there once every argument is read: one message naming every
 * required flag missing. */
static int check_complete(parse_state *ps, int n_positional)
{
    const cli_command *cmd = ps->cmd;
    char missing[1024] = "";
    size_t len = 0;
    int index = 0, n_missing = 0;
    for (const cli_table *t = cmd->tables; t && t->flags; t++)
        for (const cli_flag *f = t->flags; f->kind != CLI_END; f++) {
            if (!is_flag(f))
                continue;
            if (f->required && index < MAX_FLAGS && !ps->given[index] && len < sizeof missing) {
                len += (size_t)snprintf(missing + len, sizeof missing - len, "%s--%s%s%s", n_missing ? " and " : "",
                                        f->name, f->metavar ? " " : "", f->metavar ? f->metavar : "");
                n_missing++;
            }
            index++;
        }
    if (n_missing)
        return usage_error(cmd, ps->err, "%s %s required", missing, n_missing == 1 ? "is" : "are");
    for (int i = n_positional; i < count_positionals(cmd); i++)
        if (!cmd->positionals[i].optional)
            return usage_error(cmd, ps->err, "%s is missing", cmd->positionals[i].metavar);
    return CLI_RUN;
}

static int parse_long(parse_state *ps, int argc, char **argv, int *i)
{
    const char *arg = argv[*i] + 2, *eq = strchr(arg, '=');
    name_key key = {arg, eq ? (size_t)(eq - arg) : strlen(arg)};
    found fd;
    if (!find_flag(ps->cmd, match_name, &key, &fd))
        return usage_error(ps->cmd, ps->err, "unknown flag '--%.*s'", (int)key.len, arg);
    const char *value = NULL;
    if (!cli_flag_takes_value(fd.flag)) {
        if (eq)
            return usage_error(ps->cmd, ps->err, "--%s takes no value, got '%s'", fd.flag->name, eq + 1);
    } else if (eq) {
        value = eq + 1;
    } else if (*i + 1 < argc) {
        value = argv[++*i];
    } else {
        return usage_error(ps->cmd, ps->err, "--%s needs a value (%s)", fd.flag->name,
                           fd.flag->metavar ? fd.flag->metavar : "");
    }
    return apply(ps, &fd, value);
}

/* "-t4", "-t 4", "-gh": switches may be bundled, the last letter may take a value. */
static int parse_short(parse_state *ps, int argc, char **argv, int *i)
{
    const char *arg = argv[*i];
    for (int j = 1; arg[j]; j++) {
        char letter = arg[j];
        found fd;
        if (letter == 'h') {
            cli_usage(ps->cmd, ps->out);
            return HELP_SHOWN;
        }
        if (!find_flag(ps->cmd, match_letter, &letter, &fd))
            return usage_error(ps->cmd, ps->err, "unknown flag '-%c'", letter);
        if (!cli_flag_takes_value(fd.flag)) {
            int rc = apply(ps, &fd, NULL);
            if (rc)
                return rc;
            continue;
        }
        const char *value;
        if (arg[j + 1])
            value = arg + j + 1;
        else if (*i + 1 < argc)
            value = argv[++*i];
        else
            return usage_error(ps->cmd, ps->err, "-%c needs a value (%s)", letter,
                               fd.flag->metavar ? fd.flag->metavar : "");
        return apply(ps, &fd, value);
    }
    return 0;
}

static bool is_help(const char *arg)
{
    return !strcmp(arg, "--help") || !strcmp(arg, "-h");
}

int cli_parse_to(const cli_command *cmd, int argc, char **argv, void *opts, FILE *out, FILE *err)
{
    memset(opts, 0, cmd->opts_size);
    if (cmd->init)
        cmd->init(opts);
    /* --help wins wherever it stands: the rest of the line may be half typed. */
    for (int i = 1; i < argc && strcmp(argv[i], "--"); i++)
        if (is_help(argv[i])) {
            cli_usage(cmd, out);
            return 0;
        }
    parse_state state = {.cmd = cmd, .opts = opts, .out = out, .err = err}, *ps = &state;
    int n_positional = 0, max_positional = count_positionals(cmd), rc = 0;
    bool flags_done = false;
    for (int i = 1; i < argc && !rc; i++) {
        const char *arg = argv[i];
        if (!flags_done && !strcmp(arg, "--")) {
            flags_done = true;
        } else if (!flags_done && arg[0] == '-' && arg[1] == '-') {
            rc = parse_long(ps, argc, argv, &i);
        } else if (!flags_done && arg[0] == '-' && arg[1]) {
            rc = parse_short(ps, argc, argv, &i);
        } else if (n_positional < max_positional) {
            *(const char **)((char *)opts + cmd->positionals[n_positional++].off) = arg;
        } else {
            rc = usage_error(cmd, err, "unexpected argument '%s'", arg);
        }
    }
    if (!rc)
        rc = check_complete(ps, n_positional);
    return rc == HELP_SHOWN ? 0 : rc;
}

int cli_parse(const cli_command *cmd, int argc, char **argv, void *opts)
{
    return cli_parse_to(cmd, argc, argv, opts, stdout, stderr);
}

/* ---- help ---- */

/* Writes text from column col on, wrapping at HELP_WIDTH to column indent; "\n" in the text
 * starts a new line. */
static void print_wrapped(FILE *out, const char *text, int col, int indent)
{
    const char *p = text;
    while (*p) {
        if (*p == '\n') {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
            p++;
            continue;
        }
        if (*p == ' ') {
            p++;
            continue;
        }
        size_t len = strcspn(p, " \n");
        bool first = col == indent;
        if (!first && col + 1 + (int)len > HELP_WIDTH) {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
            first = true;
        }
        fprintf(out, "%s%.*s", first ? "" : " ", (int)len, p);
        col += (int)len + !first;
        p += len;
    }
    fputc('\n', out);
}

static const char *metavar_of(const cli_flag *f, char *buf, size_t cap)
{
    if (f->metavar)
        return f->metavar;
    if (f->kind == CLI_ENUM) {
        format_choices(buf, cap, f, "|", "|");
        return buf;
    }
    return cli_flag_takes_value(f) ? "VALUE" : "";
}

static int left_of(const cli_flag *f, char *buf, size_t cap)
{
    char mv[512];
    const char *meta = metavar_of(f, mv, sizeof mv);
    if (f->letter)
        return snprintf(buf, cap, "  -%c, --%s%s%s", f->letter, f->name, *meta ? " " : "", meta);
    return snprintf(buf, cap, "      --%s%s%s", f->name, *meta ? " " : "", meta);
}

/* The default as the help shows it; "" for none. */
static void default_of(const cli_flag *f, const void *src, char *buf, size_t cap)
{
    buf[0] = 0;
    if (f->dflt) {
        snprintf(buf, cap, "%s", f->dflt);
        return;
    }
    if (f->required || !src)
        return;
    switch (f->kind) {
    case CLI_INT:
        if (f->ctype == CLI_C_UNSIGNED && f->size == 8)
            snprintf(buf, cap, "%llu", (unsigned long long)*(const uint64_t *)src);
        else
            snprintf(buf, cap, "%lld", read_int(src, f));
        break;
    case CLI_DOUBLE:
        snprintf(buf, cap, "%g", f->ctype == CLI_C_FLOAT ? *(const float *)src : *(const double *)src);
        break;
    case CLI_SIZE: format_bytes(buf, cap, (double)*(const size_t *)src); break;
    case CLI_SIZE_OR_FRACTION: {
        const cli_size *s = src;
        if (s->fraction > 0)
            snprintf(buf, cap, "%g", s->fraction);
        else if (s->bytes)
            format_bytes(buf, cap, (double)s->bytes);
        break;
    }
    case CLI_STRING:
    case CLI_PATH:
        if (*(const char *const *)src)
            snprintf(buf, cap, "%s", *(const char *const *)src);
        break;
    case CLI_ENUM: {
        long long v = read_int(src, f);
        cli_choice c;
        for (int i = 0; cli_choice_get(f, i, &c); i++)
            if (c.value == v) {
                snprintf(buf, cap, "%s", c.name);
                break;
            }
        break;
    }
    default: break;
    }
}

/* The help text of a flag with what it accepts and its default appended, inside the help's
 * own closing parenthesis when it ends with one. */
static void help_of(const cli_flag *f, const void *src, char *buf, size_t cap)
{
    char dflt[256], accepted[1024] = "", extra[1400];
    default_of(f, src, dflt, sizeof dflt);
    if (f->kind == CLI_ENUM && f->metavar)
        format_choices(accepted, sizeof accepted, f, ", ", " or ");
    else if (f->values)
        snprintf(accepted, sizeof accepted, "%s", f->values());
    const char *status = *dflt ? "default: " : f->required ? "required" : "";
    snprintf(extra, sizeof extra, "%s%s%s%s", accepted, *accepted && *status ? "; " : "", status, dflt);
    const char *help = f->help ? f->help : "";
    size_t len = strlen(help);
    if (!*extra)
        snprintf(buf, cap, "%s", help);
    else if (len && help[len - 1] == ')')
        snprintf(buf, cap, "%.*s; %s)", (int)len - 1, help, extra);
    else
        snprintf(buf, cap, "%s%s(%s)", help, len ? " " : "", extra);
}

static void print_entry(FILE *out, const char *left, int left_len, const char *help, int column)
{
    fputs(left, out);
    int col = left_len;
    if (col + 2 > column) {
        fprintf(out, "\n%*s", column, "");
    } else {
        fprintf(out, "%*s", column - col, "");
    }
    print_wrapped(out, help, column, column);
}

static void print_help_entry(FILE *out, int column)
{
    static const char left[] = "  -h, --help";
    print_entry(out, left, (int)strlen(left), "this help", column);
}

void cli_usage(const cli_command *cmd, FILE *out)
{
    void *defaults = calloc(1, cmd->opts_size ? cmd->opts_size : 1);
    if (defaults && cmd->init)
        cmd->init(defaults);
    char left[512], help[4096];
    int column = 0;
    for (const cli_table *t = cmd->tables; t && t->flags; t++)
        for (const cli_flag *f = t->flags; f->kind != CLI_END; f++)
            if (is_flag(f)) {
                int n = left_of(f, left, sizeof left) + 2;
                if (n <= HELP_COLUMN_MAX && n > column)
                    column = n;
            }
    for (int i = 0; i < count_positionals(cmd); i++) {
        int n = (int)strlen(cmd->positionals[i].metavar) + 4;
        if (n <= HELP_COLUMN_MAX && n > column)
            column = n;
    }
    if (column < 20)
        column = 20;

    fprintf(out, "usage: blade %s %s\n\n", cmd->name, cmd->synopsis);
    if (cmd->about && *cmd->about)
        fprintf(out, "%s%s\n", cmd->about, cmd->about[strlen(cmd->about) - 1] == '\n' ? "" : "\n");
    if (count_positionals(cmd)) {
        fprintf(out, "arguments:\n");
        for (int i = 0; i < count_positionals(cmd); i++) {
            int n = snprintf(left, sizeof left, "  %s", cmd->positionals[i].metavar);
            print_entry(out, left, n, cmd->positionals[i].help, column);
        }
        fputc('\n', out);
    }
    fprintf(out, "options:\n");
    bool help_shown = false;
    for (const cli_table *t = cmd->tables; t && t->flags; t++)
        for (const cli_flag *f = t->flags; f->kind != CLI_END; f++) {
            if (f->kind == CLI_HEADING) {
                if (!help_shown)
                    print_help_entry(out, column);
                help_shown = true;
                fprintf(out, "\n%s:\n", f->help);
                continue;
            }
            int n = left_of(f, left, sizeof left);
            help_of(f, defaults ? (const char *)defaults + t->base + f->off : NULL, help, sizeof help);
            print_entry(out, left, n, help, column);
        }
    if (!help_shown)
        print_help_entry(out, column);
    if (cmd->epilogue) {
        fputc('\n', out);
        cmd->epilogue(out);
    }
    free(defaults);
}
