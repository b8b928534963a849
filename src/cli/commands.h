#ifndef BLADE_CLI_COMMANDS_H
#define BLADE_CLI_COMMANDS_H

/* One function per `blade SUBCOMMAND`; argv[0] is the subcommand name. Each returns the
 * process exit status and handles its own --help. */

int cmd_run(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_convert(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_synth(int argc, char **argv);
int cmd_quantize(int argc, char **argv);
int cmd_imatrix(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_bench_engine(int argc, char **argv);
int cmd_bench_serve(int argc, char **argv);
int cmd_bench_ablation(int argc, char **argv);
int cmd_bench_compare(int argc, char **argv);
int cmd_bench_kv_transfer(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_router(int argc, char **argv);
int cmd_batch(int argc, char **argv);
int cmd_template(int argc, char **argv);

#endif
