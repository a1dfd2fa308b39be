import Foundation

/// Renders parsed template nodes against a context, with the filters, tests, methods and globals
/// that chat templates use (`raise_exception`, `namespace`, `range`, `loop.*`, `tojson`, ...).
struct JinjaInterpreter {
    private var scopes: [[String: JinjaValue]]

    init(context: [String: JinjaValue]) { scopes = [context] }

    mutating func render(_ nodes: [JinjaNode]) throws -> String {
        var out = ""
        try render(nodes, into: &out)
        return out
    }

    private func lookup(_ name: String) -> JinjaValue {
        for scope in scopes.reversed() { if let v = scope[name] { return v } }
        return .undefined
    }

    private mutating func render(_ nodes: [JinjaNode], into out: inout String) throws {
        for node in nodes {
            switch node {
            case let .text(t):
                out += t
            case let .output(e):
                out += try eval(e).rendered
            case let .ifChain(branches, otherwise):
                if let branch = try branches.first(where: { try eval($0.0).isTruthy }) {
                    try render(branch.1, into: &out)
                } else {
                    try render(otherwise, into: &out)
                }
            case let .forLoop(targets, iterable, filter, body, otherwise):
                var items = try iterate(eval(iterable))
                if let filter {
                    items = try items.filter { item in
                        scopes.append(bind(targets, item))
                        defer { scopes.removeLast() }
                        return try eval(filter).isTruthy
                    }
                }
                if items.isEmpty { try render(otherwise, into: &out); continue }
                for (index, item) in items.enumerated() {
                    var scope = bind(targets, item)
                    scope["loop"] = .object([
                        ("index", .int(index + 1)), ("index0", .int(index)), ("first", .bool(index == 0)),
                        ("last", .bool(index == items.count - 1)), ("length", .int(items.count)),
                        ("revindex", .int(items.count - index)), ("revindex0", .int(items.count - index - 1)),
                        ("previtem", index > 0 ? items[index - 1] : .undefined),
                        ("nextitem", index + 1 < items.count ? items[index + 1] : .undefined),
                    ])
                    scopes.append(scope)
                    defer { scopes.removeLast() }
                    try render(body, into: &out)
                }
            case let .set(target, attribute, e):
                let value = try eval(e)
                if let attribute {
                    guard case let .namespace(ns) = lookup(target) else {
                        throw TokenizerError.chatTemplate("cannot set \(target).\(attribute): \(target) is not a namespace")
                    }
                    ns.values[attribute] = value
                } else {
                    scopes[scopes.count - 1][target] = value
                }
            case let .setBlock(target, body):
                var text = ""
                try render(body, into: &text)
                scopes[scopes.count - 1][target] = .string(text)
            }
        }
    }

    private func bind(_ targets: [String], _ item: JinjaValue) -> [String: JinjaValue] {
        if targets.count == 1 { return [targets[0]: item] }
        guard case let .array(parts) = item else { return [:] }
        return Dictionary(uniqueKeysWithValues: zip(targets, parts).map { ($0, $1) })
    }

    private func iterate(_ v: JinjaValue) throws -> [JinjaValue] {
        switch v {
        case let .array(a): return a
        case let .object(o, order): return order.map { _ = o; return .string($0) }
        case let .string(s): return s.map { .string(String($0)) }
        case .undefined, .none: return []
        default: throw TokenizerError.chatTemplate("cannot loop over \(v.rendered)")
        }
    }

    private func eval(_ e: JinjaExpr) throws -> JinjaValue {
        switch e {
        case let .literal(v): return v
        case let .name(n): return lookup(n)
        case let .list(items): return .array(try items.map(eval))
        case let .dict(pairs): return .object(try pairs.map { (try eval($0.0).rendered, try eval($0.1)) })
        case let .attribute(base, name): return member(try eval(base), name)
        case let .index(base, index): return try subscriptValue(try eval(base), try eval(index))
        case let .slice(base, start, stop, step):
            return try slice(try eval(base), start.map(eval), stop.map(eval), step.map(eval))
        case let .call(callee, args, named):
            return try call(callee, try args.map(eval), try named.map { ($0.0, try eval($0.1)) })
        case let .filter(base, name, args, named):
            return try applyFilter(name, try eval(base), try args.map(eval), try named.map { ($0.0, try eval($0.1)) })
        case let .test(base, name, negated, args):
            let result = try applyTest(name, try eval(base), try args.map(eval))
            return .bool(negated ? !result : result)
        case let .not(inner): return .bool(!(try eval(inner).isTruthy))
        case let .negate(inner):
            switch try eval(inner) {
            case let .int(i): return .int(-i)
            case let .double(d): return .double(-d)
            case let v: throw TokenizerError.chatTemplate("cannot negate \(v.rendered)")
            }
        case let .and(a, b):
            let left = try eval(a)
            return left.isTruthy ? try eval(b) : left
        case let .or(a, b):
            let left = try eval(a)
            return left.isTruthy ? left : try eval(b)
        case let .conditional(value, condition, otherwise):
            return try eval(condition).isTruthy ? try eval(value) : try otherwise.map(eval) ?? .undefined
        case let .binary(op, a, b):
            return try binary(op, try eval(a), try eval(b))
        }
    }

    private func binary(_ op: String, _ a: JinjaValue, _ b: JinjaValue) throws -> JinjaValue {
        switch op {
        case "==": return .bool(a == b)
        case "!=": return .bool(a != b)
        case "~": return .string(a.rendered + b.rendered)
        case "in":
            switch b {
            case let .string(s): return .bool(s.contains(a.rendered) || a.rendered.isEmpty)
            case let .array(items): return .bool(items.contains(a))
            case let .object(o, _): return .bool(o[a.rendered] != nil)
            case let .namespace(ns): return .bool(ns.values[a.rendered] != nil)
            default: return .bool(false)
            }
        case "+":
            switch (a, b) {
            case let (.string(x), .string(y)): return .string(x + y)
            case let (.array(x), .array(y)): return .array(x + y)
            case let (.int(x), .int(y)): return .int(x + y)
            default: break
            }
        case "<", ">", "<=", ">=":
            if case let .string(x) = a, case let .string(y) = b {
                let order = Array(x.unicodeScalars.map(\.value)).lexicographicallyPrecedes(Array(y.unicodeScalars.map(\.value)))
                let equal = x.unicodeScalars.elementsEqual(y.unicodeScalars)
                switch op {
                case "<": return .bool(order)
                case ">": return .bool(!order && !equal)
                case "<=": return .bool(order || equal)
                default: return .bool(!order)
                }
            }
            guard let x = a.number, let y = b.number else { break }
            switch op {
            case "<": return .bool(x < y)
            case ">": return .bool(x > y)
            case "<=": return .bool(x <= y)
            default: return .bool(x >= y)
            }
        default: break
        }
        if case let .int(x) = a, case let .int(y) = b {
            switch op {
            case "-": return .int(x - y)
            case "*": return .int(x * y)
            case "//": guard y != 0 else { break }; return .int(Int((Double(x) / Double(y)).rounded(.down)))
            case "%": guard y != 0 else { break }; return .int(((x % y) + y) % y)
            case "/": guard y != 0 else { break }; return .double(Double(x) / Double(y))
            default: break
            }
        }
        if let x = a.number, let y = b.number {
            switch op {
            case "+": return .double(x + y)
            case "-": return .double(x - y)
            case "*": return .double(x * y)
            case "/": return .double(x / y)
            default: break
            }
        }
        if op == "*", case let .string(s) = a, case let .int(n) = b { return .string(String(repeating: s, count: max(n, 0))) }
        throw TokenizerError.chatTemplate("cannot apply \(op) to \(a.pythonRepr) and \(b.pythonRepr)")
    }

    private func member(_ base: JinjaValue, _ name: String) -> JinjaValue {
        switch base {
        case let .object(o, _): return o[name] ?? .undefined
        case let .namespace(ns): return ns.values[name] ?? .undefined
        default: return .undefined
        }
    }

    private func subscriptValue(_ base: JinjaValue, _ index: JinjaValue) throws -> JinjaValue {
        switch (base, index) {
        case let (.array(a), .int(i)):
            let j = i < 0 ? a.count + i : i
            return a.indices.contains(j) ? a[j] : .undefined
        case let (.string(s), .int(i)):
            let scalars = Array(s.unicodeScalars)
            let j = i < 0 ? scalars.count + i : i
            return scalars.indices.contains(j) ? .string(String(scalars[j])) : .undefined
        case let (.object(o, _), key): return o[key.rendered] ?? .undefined
        case let (.namespace(ns), key): return ns.values[key.rendered] ?? .undefined
        default: return .undefined
        }
    }

    private func slice(_ base: JinjaValue, _ start: JinjaValue?, _ stop: JinjaValue?, _ step: JinjaValue?) throws -> JinjaValue {
        func indices(_ count: Int) -> [Int] {
            let st: Int = { if case let .int(s)? = step { return s }; return 1 }()
            func clamp(_ v: JinjaValue?, _ dflt: Int) -> Int {
                guard case let .int(x)? = v else { return dflt }
                let y = x < 0 ? x + count : x
                return st > 0 ? min(max(y, 0), count) : min(max(y, -1), count - 1)
            }
            if st > 0 { return Array(stride(from: clamp(start, 0), to: clamp(stop, count), by: st)) }
            return Array(stride(from: clamp(start, count - 1), to: clamp(stop, -1), by: st))
        }
        switch base {
        case let .array(a): return .array(indices(a.count).map { a[$0] })
        case let .string(s):
            let scalars = Array(s.unicodeScalars)
            return .string(String(String.UnicodeScalarView(indices(scalars.count).map { scalars[$0] })))
        default: throw TokenizerError.chatTemplate("cannot slice \(base.rendered)")
        }
    }

    private func call(_ callee: JinjaExpr, _ args: [JinjaValue], _ named: [(String, JinjaValue)]) throws -> JinjaValue {
        if case let .attribute(baseExpr, method) = callee {
            return try callMethod(try eval(baseExpr), method, args)
        }
        guard case let .name(function) = callee else { throw TokenizerError.chatTemplate("only named functions can be called") }
        switch function {
        case "raise_exception":
            throw TokenizerError.chatTemplate(args.first?.rendered ?? "raise_exception called")
        case "namespace":
            return .namespace(JinjaNamespace(Dictionary(named, uniquingKeysWith: { $1 })))
        case "range":
            let ints = args.compactMap { v -> Int? in if case let .int(i) = v { return i }; return nil }
            switch ints.count {
            case 1: return .array((0..<max(ints[0], 0)).map { .int($0) })
            case 2: return .array(stride(from: ints[0], to: ints[1], by: 1).map { .int($0) })
            case 3 where ints[2] != 0: return .array(stride(from: ints[0], to: ints[1], by: ints[2]).map { .int($0) })
            default: throw TokenizerError.chatTemplate("range expects 1 to 3 integers")
            }
        default:
            throw TokenizerError.chatTemplate("unknown function \(function)()")
        }
    }

    private func callMethod(_ base: JinjaValue, _ method: String, _ args: [JinjaValue]) throws -> JinjaValue {
        switch (base, method) {
        case let (.string(s), "strip"): return .string(Self.strip(s, args.first?.rendered, left: true, right: true))
        case let (.string(s), "lstrip"): return .string(Self.strip(s, args.first?.rendered, left: true, right: false))
        case let (.string(s), "rstrip"): return .string(Self.strip(s, args.first?.rendered, left: false, right: true))
        case let (.string(s), "upper"): return .string(s.uppercased())
        case let (.string(s), "lower"): return .string(s.lowercased())
        case let (.string(s), "title"): return .string(s.capitalized)
        case let (.string(s), "startswith"): return .bool(s.unicodeScalars.starts(with: (args.first?.rendered ?? "").unicodeScalars))
        case let (.string(s), "endswith"):
            return .bool(Array(s.unicodeScalars).reversed().starts(with: Array((args.first?.rendered ?? "").unicodeScalars).reversed()))
        case let (.string(s), "replace") where args.count >= 2:
            return .string(TextReplace.replacingAll(in: s, of: args[0].rendered, with: args[1].rendered))
        case let (.string(s), "split"):
            if let sep = args.first?.rendered {
                return .array(s.components(separatedBy: sep).map { .string($0) })
            }
            return .array(s.split(whereSeparator: { $0.isWhitespace }).map { .string(String($0)) })
        case let (.object(o, order), "items"): return .array(order.map { .array([.string($0), o[$0]!]) })
        case let (.object(_, order), "keys"): return .array(order.map { .string($0) })
        case let (.object(o, order), "values"): return .array(order.map { o[$0]! })
        case let (.object(o, _), "get"): return o[args.first?.rendered ?? ""] ?? (args.count > 1 ? args[1] : .none)
        default: throw TokenizerError.chatTemplate("unsupported method .\(method)() on \(base.pythonRepr)")
        }
    }

    private static func strip(_ s: String, _ chars: String?, left: Bool, right: Bool) -> String {
        let set = chars.map { Set($0.unicodeScalars) }
        func strippable(_ c: Unicode.Scalar) -> Bool { set?.contains(c) ?? c.properties.isWhitespace }
        var scalars = Array(s.unicodeScalars)
        if left { while let f = scalars.first, strippable(f) { scalars.removeFirst() } }
        if right { while let l = scalars.last, strippable(l) { scalars.removeLast() } }
        return String(String.UnicodeScalarView(scalars))
    }

    private func applyFilter(_ name: String, _ v: JinjaValue, _ args: [JinjaValue], _ named: [(String, JinjaValue)]) throws -> JinjaValue {
        switch name {
        case "trim": return .string(Self.strip(v.rendered, nil, left: true, right: true))
        case "length", "count":
            switch v {
            case let .string(s): return .int(s.unicodeScalars.count)
            case let .array(a): return .int(a.count)
            case let .object(o, _): return .int(o.count)
            default: return .int(0)
            }
        case "upper": return .string(v.rendered.uppercased())
        case "lower": return .string(v.rendered.lowercased())
        case "capitalize": return .string(v.rendered.prefix(1).uppercased() + v.rendered.dropFirst().lowercased())
        case "title": return .string(v.rendered.capitalized)
        case "string": return .string(v.rendered)
        case "safe", "e", "escape": return v
        case "tojson": return .string(v.json)
        case "int": return .int(Int(v.number ?? Double(v.rendered) ?? 0))
        case "float": return .double(v.number ?? Double(v.rendered) ?? 0)
        case "abs":
            if case let .int(i) = v { return .int(abs(i)) }
            return .double(abs(v.number ?? 0))
        case "default", "d":
            let useFalsy = args.count > 1 && args[1].isTruthy
            if case .undefined = v { return args.first ?? .string("") }
            return useFalsy && !v.isTruthy ? args.first ?? .string("") : v
        case "first": return try iterate(v).first ?? .undefined
        case "last": return try iterate(v).last ?? .undefined
        case "list": return .array(try iterate(v))
        case "reverse":
            if case let .string(s) = v { return .string(String(String.UnicodeScalarView(s.unicodeScalars.reversed()))) }
            return .array(try iterate(v).reversed())
        case "join":
            return .string(try iterate(v).map(\.rendered).joined(separator: args.first?.rendered ?? ""))
        case "replace" where args.count >= 2:
            return .string(TextReplace.replacingAll(in: v.rendered, of: args[0].rendered, with: args[1].rendered))
        case "items": return try callMethod(v, "items", [])
        case "selectattr", "rejectattr":
            guard let attribute = args.first?.rendered else { throw TokenizerError.chatTemplate("\(name) needs an attribute") }
            let keep = try iterate(v).filter { item in
                let value = member(item, attribute)
                let passes = args.count > 1 ? try applyTest(args[1].rendered, value, Array(args.dropFirst(2))) : value.isTruthy
                return name == "selectattr" ? passes : !passes
            }
            return .array(keep)
        case "map":
            if let attribute = named.first(where: { $0.0 == "attribute" })?.1.rendered {
                return .array(try iterate(v).map { member($0, attribute) })
            }
            guard let filter = args.first?.rendered else { throw TokenizerError.chatTemplate("map needs a filter or attribute") }
            return .array(try iterate(v).map { try applyFilter(filter, $0, Array(args.dropFirst()), []) })
        default:
            throw TokenizerError.chatTemplate("unsupported filter |\(name)")
        }
    }

    private func applyTest(_ name: String, _ v: JinjaValue, _ args: [JinjaValue]) throws -> Bool {
        switch name {
        case "defined": if case .undefined = v { return false }; return true
        case "undefined": if case .undefined = v { return true }; return false
        case "none": if case .none = v { return true }; return false
        case "string": if case .string = v { return true }; return false
        case "number": switch v { case .int, .double: return true; default: return false }
        case "integer": if case .int = v { return true }; return false
        case "mapping": switch v { case .object, .namespace: return true; default: return false }
        case "sequence", "iterable": switch v { case .array, .string, .object: return true; default: return false }
        case "boolean": if case .bool = v { return true }; return false
        case "true": return v == .bool(true)
        case "false": return v == .bool(false)
        case "even": if case let .int(i) = v { return i % 2 == 0 }; return false
        case "odd": if case let .int(i) = v { return i % 2 != 0 }; return false
        case "equalto", "eq", "==": return v == (args.first ?? .undefined)
        case "ne", "!=": return v != (args.first ?? .undefined)
        default: throw TokenizerError.chatTemplate("unsupported test \"is \(name)\"")
        }
    }
}
