// Command-line reading shared by the scripts under scripts/: flags with strictly checked numbers,
// and the rule that they only ever target a server on the loopback interface.

// Calls onFlag(flag, value, number) for each argument: value() takes the flag's value,
// number(min, max) takes it as a number within [min, max]; either throws naming the flag.
export function readFlags(argv, onFlag) {
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${flag} needs a value`);
      return argv[++i];
    };
    const number = (min, max) => {
      const v = value();
      const x = Number(v);
      if (!Number.isFinite(x) || x < min || x > max) throw new Error(`${flag} expects a number in [${min}, ${max}], got '${v}'`);
      return x;
    };
    onFlag(flag, value, number);
  }
}

// The parts of an http:// URL on the loopback interface (127.0.0.0/8, ::1 or localhost); what
// names the script in the refusal.
export function loopbackUrl(url, what) {
  if (!url) throw new Error('--url is required');
  const u = new URL(url);
  const host = u.hostname.replace(/^\[|\]$/g, '');
  if (!(host === 'localhost' || host === '::1' || /^127\.\d+\.\d+\.\d+$/.test(host)))
    throw new Error(`refusing ${url}: ${what} only targets the loopback interface`);
  if (u.protocol !== 'http:') throw new Error(`refusing ${url}: expected an http:// URL`);
  return { host, port: Number(u.port || 80), base: `${u.protocol}//${u.host}` };
}
