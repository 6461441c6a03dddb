// A gRPC client from @grpc/grpc-js, Node's own HTTP/2 (nghttp2), for
// tests/collector/test_grpc_clients.py. Usage: node client.js HOST:PORT WORKERS CALLS EVENTS
// It sends WORKERS concurrent loops of CALLS SendEvent calls of EVENTS events each over one
// channel, every other call gzip-compressed, then one call to a method the server does not have
// and one over the message limit; it prints one JSON object with what came back.
'use strict';
const grpc = require('@grpc/grpc-js');

const [target, workers, calls, events] = [process.argv[2], ...process.argv.slice(3, 6).map(Number)];

function varint(n) {
  const out = [];
  while (n > 127) { out.push((n & 127) | 128); n = Math.floor(n / 128); }
  out.push(n);
  return Buffer.from(out);
}
const field = (num, buf) => Buffer.concat([varint(num * 8 + 2), varint(buf.length), buf]);

// SendEventRequest: req_guid = 1, events = 3 (Event: event_bytes = 1, type = 2)
function request(guid, n) {
  const parts = [field(1, Buffer.from(guid))];
  for (let i = 0; i < n; i++) {
    parts.push(field(3, Buffer.concat([
      field(1, Buffer.from(`${guid}/${i}`)), field(2, Buffer.from('grpcjs')),
    ])));
  }
  return Buffer.concat(parts);
}

// SendEventResponse: status = 1 (varint; SUCCESS is 1)
function status(resp) {
  return resp.length >= 2 && resp[0] === 0x08 ? resp[1] : -1;
}

const same = (b) => b;
const method = (name) => ({
  path: `/raystack.raccoon.v1beta1.EventService/${name}`,
  requestStream: false, responseStream: false,
  requestSerialize: same, requestDeserialize: same, responseSerialize: same, responseDeserialize: same,
});
const Client = grpc.makeGenericClientConstructor({ SendEvent: method('SendEvent'), Other: method('Other') });
const plain = new Client(target, grpc.credentials.createInsecure());
const zipped = new Client(target, grpc.credentials.createInsecure(), {
  'grpc.default_compression_algorithm': 2, // gzip
});

function call(client, name, message, user) {
  return new Promise((resolve) => {
    const metadata = new grpc.Metadata();
    metadata.add('x-user-id', user);
    client[name](message, metadata, { deadline: Date.now() + 30000 }, (err, resp) => resolve([err, resp]));
  });
}

(async () => {
  const out = { ok: 0, problems: [] };
  const loops = [];
  for (let w = 0; w < workers; w++) {
    loops.push((async () => {
      for (let i = 0; i < calls; i++) {
        const [err, resp] = await call(i % 2 ? zipped : plain, 'SendEvent', request(`js-${w}-${i}`, events), `js-${w}`);
        if (err || status(resp) !== 1) out.problems.push(err ? `${err.code} ${err.details}` : `status ${status(resp)}`);
        else out.ok++;
      }
    })());
  }
  await Promise.all(loops);
  const [other] = await call(plain, 'Other', request('other', 1), 'js');
  out.other = other ? [other.code, other.details] : null;
  const [big] = await call(plain, 'SendEvent', Buffer.alloc(6 * 1024 * 1024, 1), 'js');
  out.big = big ? [big.code, big.details] : null;
  plain.close();
  zipped.close();
  process.stdout.write(JSON.stringify(out) + '\n');
})();
