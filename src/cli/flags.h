#ifndef BLADE_CLI_FLAGS_H
#define BLADE_CLI_FLAGS_H

/* The command line of every blade subcommand, declared once as data: a table of flags (long
 * name, short letter, kind, range, where the value goes, help) and the positional arguments.
 * The same table parses argv and writes `blade CMD --help`, so the help cannot drift from
 * what is parsed, and the default it shows is the value the command's init function sets.
 *
 * A flag writes into the command's options struct: each row names a field with CLI_AT(T, f),
 * which records its offset, size and C type (test_cli checks that the type fits the kind). A
 * command lists its tables with the offset of the struct each describes, so a group of flags
 * several commands share (engine_options.h, eval_options.h, load_options.h) is declared once
 * and embedded as a member.
 *
 * How to add a flag
 *   1. Add the field to the options struct, and set its default in the init function when it
 *      is not zero.
 *   2. Add a row to the command's table (or to the shared table, for every command using it):
 *        {.name = "max-queue", .kind = CLI_INT, CLI_AT(serve_options, max_queue),
 *         .min = 1, .max = 1 << 20, .metavar = "N", .help = "requests waiting to start before 429"},
 *      Kinds: CLI_BOOL (a switch; .negate clears the field instead), CLI_INT and CLI_DOUBLE
 *      (.min/.max; a double .max of INFINITY also takes "inf"), CLI_SIZE (bytes, "8M"),
 *      CLI_SIZE_OR_FRACTION (cli_size: bytes or a fraction in (0, 1)), CLI_STRING, CLI_PATH,
 *      CLI_ENUM (.choices, or .choice_at for names kept in a table elsewhere), CLI_LIST
 *      (repeatable, cli_list), CLI_CUSTOM (.parse). .required makes the flag mandatory; .dflt
 *      replaces the default shown ("" shows none), e.g. "physical cores" for a 0 that means it.
 *   3. A short letter only for a flag used often, and only with the meaning it has in every
 *      other command: -m model, -t threads, -c ctx-size, -f file, -p prompt, -n n-predict,
 *      -o output, ... test_cli fails when a letter names two long flags anywhere, and when
 *      `blade CMD --help` misses a flag.
 *   Nothing else: the parser, the help, the error messages and the tests pick the row up. A new
 *   command adds its cli_command to cli_commands (commands.c). */

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef enum cli_kind {
    CLI_END = 0,          /* ends a table */
    CLI_HEADING,          /* not a flag: starts a section of the help, titled .help */
    CLI_BOOL,             /* takes no value: sets the bool, or clears it with .negate */
    CLI_INT,              /* an integer in [.min, .max] */
    CLI_DOUBLE,           /* a number in [.min, .max]; with .max INFINITY, "inf" too */
    CLI_SIZE,             /* bytes in [.min, .max], with an optional K/M/G/T/P suffix: size_t */
    CLI_SIZE_OR_FRACTION, /* the same, or a plain number in (0, 1): cli_size */
    CLI_STRING,           /* text, not empty unless .empty_ok; the argv pointer is kept */
    CLI_PATH,             /* a file name (not empty) */
    CLI_ENUM,             /* one of the choices' names, any case; stores the choice's value */
    CLI_LIST,             /* repeatable: every value in order (cli_list) */
    CLI_CUSTOM,           /* .parse turns the text into the value */
} cli_kind;

/* The C type of a destination, as CLI_AT sees it. */
typedef enum cli_ctype {
    CLI_C_OTHER,
    CLI_C_BOOL,
    CLI_C_SIGNED,
    CLI_C_UNSIGNED,
    CLI_C_FLOAT,
    CLI_C_DOUBLE,
    CLI_C_STRING,
    CLI_C_SIZE,
    CLI_C_LIST,
} cli_ctype;

/* A memory amount given either way; fraction > 0 when it was a fraction. */
typedef struct cli_size {
    size_t bytes;
    double fraction;
} cli_size;

#define CLI_LIST_MAX 64
typedef struct cli_list {
    const char *items[CLI_LIST_MAX];
    int n;
} cli_list;

typedef struct cli_choice {
    const char *name;
    int value;
} cli_choice;

typedef struct cli_flag cli_flag;
struct cli_flag {
    const char *name; /* long name, without the dashes */
    char letter;      /* short form, or 0 */
    cli_kind kind;
    size_t off, size; /* the destination: CLI_AT */
    cli_ctype ctype;
    double min, max;  /* CLI_INT, CLI_DOUBLE, CLI_SIZE, CLI_SIZE_OR_FRACTION (bytes) */
    const cli_choice *choices;                 /* CLI_ENUM: ends with a NULL name... */
    bool (*choice_at)(int i, cli_choice *out); /* ...or the i-th choice; false past the last */
    /* CLI_CUSTOM: stores the value, or writes why not (a whole sentence) and returns false */
    bool (*parse)(const cli_flag *f, const char *value, void *dest, char *why, size_t why_cap);
    const char *(*values)(void); /* accepted values to list in the help, where not an enum */
    const char *metavar;         /* the value's name in the help: N, FILE, ... */
    const char *help;
    const char *dflt;            /* the default shown; NULL: the initial value; "": none */
    bool required;
    bool negate;   /* CLI_BOOL: clears the field */
    bool empty_ok; /* CLI_STRING: "" is a value */
};

#define CLI_CTYPE_OF(x)                                                                                     \
    _Generic((x), _Bool: CLI_C_BOOL, char: CLI_C_SIGNED, signed char: CLI_C_SIGNED, short: CLI_C_SIGNED,    \
        int: CLI_C_SIGNED, long: CLI_C_SIGNED, long long: CLI_C_SIGNED, unsigned char: CLI_C_UNSIGNED,      \
        unsigned short: CLI_C_UNSIGNED, unsigned int: CLI_C_UNSIGNED, unsigned long: CLI_C_UNSIGNED,         \
        unsigned long long: CLI_C_UNSIGNED, float: CLI_C_FLOAT, double: CLI_C_DOUBLE, char *: CLI_C_STRING, \
        const char *: CLI_C_STRING, cli_size: CLI_C_SIZE, cli_list: CLI_C_LIST, default: CLI_C_OTHER)
/* The destination of a flag: member `field` of the options struct T. */
#define CLI_AT(T, field) \
    .off = offsetof(T, field), .size = sizeof(((T *)0)->field), .ctype = CLI_CTYPE_OF(((T *)0)->field)
/* An integer flag's .max for "any int64": INT64_MAX itself has no exact double. */
#define CLI_INT64_MAX 0x1p63
#define CLI_SECTION(title) {.kind = CLI_HEADING, .help = (title)}

/* A table of flags and the offset, in the command's options struct, of the struct its
 * CLI_AT rows name. */
typedef struct cli_table {
    const cli_flag *flags;
    size_t base;
} cli_table;

/* A positional argument: kept as a const char * member of the options struct, named by
 * CLI_ARG_AT(T, field). */
typedef struct cli_positional {
    const char *metavar;
    const char *help;
    size_t off;
    bool optional;
} cli_positional;

#define CLI_ARG_AT(T, field) .off = offsetof(T, field)

typedef struct cli_command cli_command;
struct cli_command {
    const char *name;     /* as typed after `blade`: "run", "bench engine" */
    const char *summary;  /* one line for `blade --help` */
    const char *synopsis; /* the usage line after the name */
    const char *about;    /* paragraphs after the usage line, wrapped as written */
    const cli_table *tables;           /* ends with a NULL .flags */
    const cli_positional *positionals; /* ends with a NULL .metavar; may be NULL */
    size_t opts_size;
    void (*init)(void *opts); /* the defaults, over a zeroed struct; may be NULL */
    /* Called after each flag is stored; false stops the parse as a usage error (it has
     * written its message to err). May be NULL. */
    bool (*observe)(void *opts, const cli_flag *f, const char *value, FILE *err);
    void (*epilogue)(FILE *out); /* text after the flags that is computed; may be NULL */
    int (*main)(int argc, char **argv);
};

/* cli_parse's result when the command should go on; otherwise it is the exit status (0
 * after --help, 2 after a usage error). */
#define CLI_RUN (-1)

/* Sets opts to the defaults and parses argv[1..] (argv[0] names the subcommand): flags,
 * --name=value, -xVALUE, bundled switches, positionals anywhere, "--" ending the flags. The
 * help goes to stdout, errors to stderr. */
int cli_parse(const cli_command *cmd, int argc, char **argv, void *opts);
/* The same, writing the help to out and errors to err. */
int cli_parse_to(const cli_command *cmd, int argc, char **argv, void *opts, FILE *out, FILE *err);
/* `blade CMD --help`. */
void cli_usage(const cli_command *cmd, FILE *out);
/* Reports a usage error found after parsing (e.g. two flags that exclude each other) the way
 * the parser does, on stderr; returns 2, the exit status. */
int cli_usage_error(const cli_command *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* For CLI_CUSTOM parsers: a whole decimal integer in [min, max]. */
bool cli_int_in(const char *s, long long min, long long max, long long *out);
/* An enum's i-th choice; false past the last. */
bool cli_choice_get(const cli_flag *f, int i, cli_choice *out);
/* Whether the flag reads a value after it (every kind but CLI_BOOL). */
bool cli_flag_takes_value(const cli_flag *f);

#endif
