import Foundation

/// A value inside a chat template (the subset of Jinja's Python values templates use).
indirect enum JinjaValue: Equatable {
    case undefined
    case none
    case bool(Bool)
    case int(Int)
    case double(Double)
    case string(String)
    case array([JinjaValue])
    case object([String: JinjaValue], order: [String])
    case namespace(JinjaNamespace)

    static func == (lhs: JinjaValue, rhs: JinjaValue) -> Bool {
        switch (lhs, rhs) {
        case (.undefined, .undefined), (.none, .none): return true
        case let (.bool(a), .bool(b)): return a == b
        case let (.string(a), .string(b)): return a.unicodeScalars.elementsEqual(b.unicodeScalars)
        case let (.array(a), .array(b)): return a == b
        case let (.object(a, _), .object(b, _)): return a == b
        case let (.namespace(a), .namespace(b)): return a === b
        default:
            if let a = lhs.number, let b = rhs.number { return a == b }
            return false
        }
    }

    /// An object from key-value pairs, keeping their order.
    static func object(_ pairs: [(String, JinjaValue)]) -> JinjaValue {
        var dict: [String: JinjaValue] = [:]
        var order: [String] = []
        for (k, v) in pairs {
            if dict[k] == nil { order.append(k) }
            dict[k] = v
        }
        return .object(dict, order: order)
    }

    var number: Double? {
        switch self {
        case let .int(i): return Double(i)
        case let .double(d): return d
        case let .bool(b): return b ? 1 : 0
        default: return nil
        }
    }

    /// Python truthiness.
    var isTruthy: Bool {
        switch self {
        case .undefined, .none: return false
        case let .bool(b): return b
        case let .int(i): return i != 0
        case let .double(d): return d != 0
        case let .string(s): return !s.isEmpty
        case let .array(a): return !a.isEmpty
        case let .object(o, _): return !o.isEmpty
        case .namespace: return true
        }
    }

    /// What `{{ value }}` prints (Python's `str`).
    var rendered: String {
        switch self {
        case .undefined: return ""
        case .none: return "None"
        case let .bool(b): return b ? "True" : "False"
        case let .int(i): return String(i)
        case let .double(d): return d == d.rounded() && abs(d) < 1e16 ? String(format: "%.1f", d) : String(d)
        case let .string(s): return s
        case .array, .object, .namespace: return pythonRepr
        }
    }

    /// Python's `repr`, used when a list or dict is printed.
    var pythonRepr: String {
        switch self {
        case let .string(s):
            return "'" + s.replacingOccurrences(of: "\\", with: "\\\\").replacingOccurrences(of: "'", with: "\\'")
                .replacingOccurrences(of: "\n", with: "\\n") + "'"
        case let .array(a): return "[" + a.map(\.pythonRepr).joined(separator: ", ") + "]"
        case let .object(o, order): return "{" + order.map { "'\($0)': \(o[$0]!.pythonRepr)" }.joined(separator: ", ") + "}"
        case .namespace: return "<Namespace>"
        default: return rendered
        }
    }

    /// JSON text as transformers' `tojson` filter writes it (`json.dumps`, non-ASCII kept).
    var json: String {
        switch self {
        case .undefined, .none: return "null"
        case let .bool(b): return b ? "true" : "false"
        case let .int(i): return String(i)
        case let .double(d): return String(d)
        case let .string(s):
            var out = "\""
            for scalar in s.unicodeScalars {
                switch scalar {
                case "\"": out += "\\\""
                case "\\": out += "\\\\"
                case "\n": out += "\\n"
                case "\r": out += "\\r"
                case "\t": out += "\\t"
                default:
                    if scalar.value < 0x20 { out += String(format: "\\u%04x", scalar.value) } else { out.unicodeScalars.append(scalar) }
                }
            }
            return out + "\""
        case let .array(a): return "[" + a.map(\.json).joined(separator: ", ") + "]"
        case let .object(o, order): return "{" + order.map { JinjaValue.string($0).json + ": " + o[$0]!.json }.joined(separator: ", ") + "}"
        case let .namespace(ns): return JinjaValue.object(ns.values.map { ($0.key, $0.value) }.sorted { $0.0 < $1.0 }).json
        }
    }

    /// Converts a Swift value (String, Bool, Int, Double, arrays, dictionaries) to a template value.
    static func from(_ any: Any?) -> JinjaValue {
        switch any {
        case nil: return .none
        case let v as JinjaValue: return v
        case let v as String: return .string(v)
        case let v as Bool: return .bool(v)
        case let v as Int: return .int(v)
        case let v as Double: return .double(v)
        case let v as [Any]: return .array(v.map { from($0) })
        case let v as [String: Any]: return object(v.keys.sorted().map { ($0, from(v[$0])) })
        default: return .string("\(any!)")
        }
    }
}

/// Jinja's `namespace()`: a mutable object that `{% set ns.x = ... %}` can change from inside a loop.
final class JinjaNamespace {
    var values: [String: JinjaValue]
    init(_ values: [String: JinjaValue]) { self.values = values }
}
